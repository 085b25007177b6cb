"""``nmt demo``: the whole pipeline on the embedded numbers-in-words task, on a CPU, no download.

It writes a small corpus (nmt/demo_data.py), a recipe for it, and runs that recipe with
nmt/pipeline.py, so the demo exercises exactly the code a real run does.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from nmt.demo_data import write_demo_corpus
from nmt.files import atomic_write
from nmt.pipeline import PipelineReport, run_recipe


def demo_recipe(workdir: Path, raw: dict[str, Path], max_update: int, max_time: str) -> dict:
    return {
        "preprocess": {
            "source_lang": "en", "target_lang": "de",
            "trainpref": str(raw["train"]), "validpref": str(raw["valid"]), "testpref": str(raw["test"]),
            "destdir": str(workdir / "data-bin"), "vocab_size": 400, "workers": 2,
        },
        "arch": "transformer_tiny",
        "model": {"d_model": 128, "ffn_dim": 256, "heads": 4, "dropout": 0.1},
        "train": {
            "save_dir": str(workdir / "checkpoints"), "device": "cpu", "max_tokens": 4096, "lr": 0.002,
            "warmup_updates": 100, "max_update": max_update, "max_time": max_time, "save_interval_updates": 50,
            "keep_interval_updates": 3, "validate_interval_updates": 50, "log_interval": 25, "seed": 1,
        },
        "average": {"num_update_checkpoints": 3, "output": str(workdir / "checkpoints" / "averaged.pt")},
        "generate": {"split": "test", "beam": 4, "lenpen": 0.6, "output": str(workdir / "test.hyp.de")},
        "score": {"metrics": "bleu,chrf"},
    }


def run_demo(
    workdir: str | Path = "nmt-demo", max_update: int = 300, max_time: str = "10m", train_size: int = 20_000
) -> PipelineReport:
    workdir = Path(workdir)
    raw = write_demo_corpus(workdir / "raw", train_size=train_size, valid_size=300, test_size=500, seed=1)
    recipe_path = workdir / "demo.yaml"
    with atomic_write(recipe_path) as handle:
        yaml.safe_dump(demo_recipe(workdir, raw, max_update, max_time), handle, sort_keys=False, allow_unicode=True)
    return run_recipe(recipe_path)
