"""Automatic precision: bf16 only where the hardware computes it natively, with the reason said."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from nmt import device as device_module
from nmt.checkpoint.format import load_checkpoint
from nmt.device import autocast, resolve_precision
from nmt.errors import NmtError

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags,expected,reason", [
    ({"avx2", "avx512f", "avx512_bf16"}, "bf16", "auto: this CPU has avx512_bf16"),
    ({"avx2", "amx_bf16", "amx_tile"}, "bf16", "auto: this CPU has amx_bf16"),
    ({"avx512_bf16", "amx_bf16"}, "bf16", "auto: this CPU has amx_bf16/avx512_bf16"),
    ({"avx2", "avx512f", "avx512_vnni"}, "fp32", "auto: this CPU has no avx512_bf16/amx"),
    (set(), "fp32", "auto: this CPU has no avx512_bf16/amx"),
])
def test_auto_on_cpu_follows_the_bf16_flags(monkeypatch, flags, expected, reason):
    monkeypatch.setattr(device_module, "cpu_flags", lambda: flags)
    assert resolve_precision("auto", CPU) == (expected, reason)


@pytest.mark.parametrize("capability,expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp32"),
                                                 ((6, 0), "fp32")])
def test_auto_on_cuda_takes_bf16_where_the_gpu_computes_it_natively(monkeypatch, capability, expected):
    # torch.cuda.is_bf16_supported() says yes on a T4 (7.5) too, where bf16 is only emulated
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    precision, reason = resolve_precision("auto", torch.device("cuda"))
    assert precision == expected and "Fake GPU" in reason


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_explicit_precision_is_kept(monkeypatch, precision):
    monkeypatch.setattr(device_module, "cpu_flags", lambda: {"amx_bf16"})
    assert resolve_precision(precision, CPU) == (precision, "asked for")


def test_cpu_flags_reads_this_machine():
    flags = device_module.cpu_flags()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system: cpu_flags() has nothing to read")
    first = cpuinfo.split("\n\n")[0]
    listed = next((line.partition(":")[2].split() for line in first.splitlines()
                   if line.split(":")[0].strip() == "flags"), None)
    if listed is None:
        pytest.skip("/proc/cpuinfo has no x86 flags line here")
    assert flags == set(listed) and "sse2" in flags


def test_autocast_resolves_auto(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_flags", lambda: {"avx512_bf16"})
    with autocast(CPU, "auto"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(device_module, "cpu_flags", lambda: set())
    with autocast(CPU, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(NmtError, match="unknown precision"):
        autocast(CPU, "fp8")


@pytest.mark.parametrize("flags,expected", [({"avx512_bf16"}, "bf16"), (set(), "fp32")])
def test_training_logs_and_stores_the_resolved_precision(tiny_data_dir, tmp_path, monkeypatch, messages, flags,
                                                         expected):
    from nmt.training.config import load_train_config
    from nmt.training.trainer import train

    monkeypatch.setattr(device_module, "cpu_flags", lambda: flags)
    config = load_train_config({"data": str(tiny_data_dir), "arch": "transformer_tiny", "save_dir": str(tmp_path),
                                "max_tokens": 1000, "max_update": 1, "device": "cpu"})
    assert config.compute.precision == "auto"
    train(config)
    assert f"precision: {expected} ({resolve_precision('auto', CPU)[1]})" in messages
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["train"]["precision"] == expected
    assert load_checkpoint(tmp_path / "checkpoint_last.pt")["train_config"]["train"]["precision"] == expected
