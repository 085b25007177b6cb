"""``nmt demo``: the whole pipeline on the embedded numbers-in-words task, on a CPU, no download.

It writes a small corpus (nmt/demo_data.py), a recipe for it, and runs that recipe with
nmt/pipeline.py, so the demo exercises exactly the code a real run does. It has no time limit
(a slow machine takes longer, it does not end with fewer checkpoints than the recipe averages),
says at the start how long training should take here, and can be run again in the same
directory: the corpus is rewritten only when it changed, so preprocessing finds its data
directory up to date and training finds its last checkpoint.
"""

from __future__ import annotations

import filecmp
import os
import tempfile
import time
from pathlib import Path

import torch
import yaml

from nmt.data.vocabulary import PAD_ID
from nmt.demo_data import write_demo_corpus
from nmt.errors import NmtError
from nmt.files import atomic_write
from nmt.log import logger
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.pipeline import PipelineReport, run_recipe


def demo_recipe(workdir: Path, raw: dict[str, Path], max_update: int, max_time: str | None = None) -> dict:
    # Checkpoints every 50 updates, the last 3 averaged; a shorter run saves more often, so that
    # even one update leaves a checkpoint to average.
    interval = max(1, min(50, max_update // 3))
    averaged = min(3, max_update // interval)
    return {
        "preprocess": {
            "source_lang": "en", "target_lang": "de",
            "trainpref": str(raw["train"]), "validpref": str(raw["valid"]), "testpref": str(raw["test"]),
            "destdir": str(workdir / "data-bin"), "vocab_size": 400, "workers": 2,
            "byte_fallback": False,  # the corpus is its own alphabet; 256 byte pieces would leave 400 - 256 for BPE
        },
        "arch": "transformer_tiny",
        "model": {"d_model": 128, "ffn_dim": 256, "heads": 4, "dropout": 0.1},
        "train": {
            "save_dir": str(workdir / "checkpoints"), "device": "cpu", "max_tokens": 4096, "lr": 0.002,
            "warmup_updates": 100, "max_update": max_update, "max_time": max_time,
            "save_interval_updates": interval, "keep_interval_updates": averaged, "validate_interval_updates": interval,
            "log_interval": min(25, interval), "seed": 1,
        },
        "average": {"num_update_checkpoints": averaged, "output": str(workdir / "checkpoints" / "averaged.pt")},
        "generate": {"split": "test", "beam": 4, "lenpen": 0.6, "output": str(workdir / "test.hyp.de")},
        "score": {"metrics": "bleu,chrf"},
    }


def write_corpus_if_changed(directory: Path, train_size: int) -> dict[str, Path]:
    """The demo corpus in ``directory``; files that already hold the same text are left untouched."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".new-") as scratch:
        fresh = write_demo_corpus(scratch, train_size=train_size, valid_size=300, test_size=500, seed=1)
        paths = {}
        for key, path in fresh.items():
            paths[key] = directory / path.name
            if "." in key and not (paths[key].exists() and filecmp.cmp(path, paths[key], shallow=False)):
                os.replace(path, paths[key])
    return paths


def seconds_per_update(recipe: dict, repeats: int = 3) -> float:
    """Time a few training steps of the demo's model on a batch of its size, here and now."""
    arch = get_arch(recipe["arch"])
    vocab = recipe["preprocess"]["vocab_size"]
    model = build_model(arch.model_name, resolve_config(arch.config, recipe["model"]), vocab, vocab, PAD_ID)
    optimizer = torch.optim.AdamW(model.parameters())
    length = 24  # about the corpus' longest sentences, in pieces
    tokens = torch.randint(4, vocab, (recipe["train"]["max_tokens"] // length, length))
    timings = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        logits = model(tokens, tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        timings.append(time.perf_counter() - started)
    return min(timings[1:])


def check_resumable(workdir: Path, max_update: int) -> None:
    """A demo resumes only its own run: another --max-update saves and averages other checkpoints."""
    config = workdir / "checkpoints" / "config.yaml"
    try:
        before = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("train", {}).get("max_update")
    except (OSError, yaml.YAMLError, AttributeError):
        return
    if before is not None and before != max_update:
        raise NmtError(f"{workdir} holds a demo run of --max-update {before}: resume it with --max-update {before}, "
                       f"or start another with a new --workdir (or after removing {workdir})")


def run_demo(workdir: str | Path = "nmt-demo", max_update: int = 300, train_size: int = 20_000) -> PipelineReport:
    workdir = Path(workdir)
    if max_update < 1:
        raise NmtError(f"--max-update must be at least 1, got {max_update}")
    try:
        (workdir / "raw").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NmtError(f"cannot use --workdir {workdir}: {exc.strerror or exc}") from exc
    check_resumable(workdir, max_update)
    raw = write_corpus_if_changed(workdir / "raw", train_size)
    recipe = demo_recipe(workdir, raw, max_update)
    recipe_path = workdir / "demo.yaml"
    with atomic_write(recipe_path) as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False, allow_unicode=True)
    step = seconds_per_update(recipe)
    logger.info("the demo trains %d updates of a small Transformer on the CPU: about %d min here "
                "(%.1f s per update measured just now), plus a minute or two for the data and the translations",
                max_update, max(1, round(max_update * step / 60)), step)
    return run_recipe(recipe_path)
