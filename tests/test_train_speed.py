"""benchmarks/train_speed.py and scale.py drive the trainer's own update step: they run on the current
trainer (no timing asserted here: the benchmarks print their tables)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    """A benchmark script as a module (its siblings importable, as when it runs)."""
    if name not in sys.modules:
        sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.slow
def test_train_speed_times_updates_and_the_matmul_limit_beside_them(tiny_data_dir, tmp_path):
    result = script("train_speed").measure_speed(tiny_config(tiny_data_dir, tmp_path, valid_subset="none"),
                                                 warmup=1, updates=2, threads=1)
    assert result["tokens_per_second"] > 0 and result["seconds_per_update"] > 0
    assert result["limits"]["fp32"] > 0 and result["tflops"] > 0


@pytest.mark.slow
def test_scale_reaches_the_first_update(tiny_data_dir):
    result = script("scale").startup(str(tiny_data_dir), 1000)
    assert result["pairs"] == 300 and result["batches"] > 0 and result["first_update"] > 0
