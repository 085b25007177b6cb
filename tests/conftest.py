"""Shared fixtures and helpers: tiny data directories built without `nmt preprocess`, running the
CLI (in this process or as `python -m nmt`), and the tiny training configuration."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from nmt.backends.torch_backend import TorchBackend
from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_state, save_checkpoint
from nmt.cli import main
from nmt.data.dataset import DataDir, write_token_array
from nmt.data.meta import DatasetMeta, SplitMeta
from nmt.data.vocabulary import EOS_ID, PAD_ID, Vocabulary
from nmt.demo_data import demo_pairs, sample_numbers
from nmt.log import logger
from nmt.models.registry import build_model, get_arch
from nmt.training.config import TrainConfig, load_train_config

# One intra-op thread for the tests and the commands they start: tiny models gain nothing from
# more, and on a machine whose cores are busy with other work, OpenMP threads waiting for each
# other made single steps 10-40x slower (measured on the 2-core development VM).
os.environ.setdefault("OMP_NUM_THREADS", "1")
THREADS = int(os.environ["OMP_NUM_THREADS"])
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def threads_as_they_were():
    """A test that fakes torch's thread count can leave it set (workers restore the count they read):
    put it back, so that a later test's forked workers are not started with threads a fork cannot keep."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)

SHARED = Path(__file__).resolve().parents[2] / "shared"
MULTI30K = SHARED / "data" / "multi30k"


def make_data_dir(directory: Path, splits: dict[str, list[tuple[str, str]]], vocab_size: int = 120,
                  source_lang: str = "en", target_lang: str = "de") -> Path:
    """A finished data directory (joint sentencepiece vocabulary) from (source, target) text pairs."""
    directory.mkdir(parents=True, exist_ok=True)
    text = [side for pairs in splits.values() for pair in pairs for side in pair]
    vocab = Vocabulary.train(text, vocab_size=vocab_size)
    vocab.save(directory / "spm.model")
    for split, pairs in splits.items():
        for lang, side in ((source_lang, 0), (target_lang, 1)):
            sentences = [vocab.encode(pair[side]) + [EOS_ID] for pair in pairs]
            write_token_array(directory / f"{split}.{lang}", sentences, len(vocab))
    DatasetMeta(source_lang, target_lang, vocab_files={source_lang: "spm.model", target_lang: "spm.model"},
                splits={split: SplitMeta(sentences=len(pairs)) for split, pairs in splits.items()}).save(directory)
    return directory


def numbers_pairs(count: int, seed: int, max_number: int = 9_999) -> list[tuple[str, str]]:
    """English -> German numbers-in-words sentences (nmt.demo_data), short enough for tiny tests."""
    return demo_pairs(sample_numbers(count, seed, max_number), seed)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """300 training and 40 validation EN->DE pairs of the numbers task; vocabulary of 120 pieces."""
    pairs = numbers_pairs(340, seed=0)
    return make_data_dir(tmp_path_factory.mktemp("tiny-data"), {"train": pairs[:300], "valid": pairs[300:]})


@pytest.fixture(scope="session")
def untrained_checkpoint(tiny_data_dir, tmp_path_factory) -> Path:
    """A deterministic (seed 0), untrained transformer_tiny over tiny_data_dir's vocabulary."""
    vocab = DataDir.open(tiny_data_dir).vocabulary("en")
    torch.manual_seed(0)
    arch = get_arch("transformer_tiny")
    model = build_model(arch.model_name, arch.config, len(vocab), len(vocab), PAD_ID)
    path = tmp_path_factory.mktemp("untrained") / "model.pt"
    save_checkpoint(path, model_state(model, "transformer_tiny", arch.config, Vocabularies("en", "de", vocab, vocab)))
    return path


def run_nmt(*args, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m nmt ARGS` in a new process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "nmt", *map(str, args)], capture_output=True, text=True, input=stdin,
                          timeout=timeout)


def run_cli(monkeypatch, capsys, *args, stdin: str = "") -> tuple[int, str, str]:
    """`nmt ARGS` in this process, through the same main() as the console script: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["nmt", *map(str, args)])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8"))))
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_one_line_error(stderr: str | subprocess.CompletedProcess, *expected: str) -> str:
    """stderr is exactly one `error: ...` line holding every expected text, and no traceback (a finished
    process must also have exited with 1)."""
    if isinstance(stderr, subprocess.CompletedProcess):
        assert stderr.returncode == 1, stderr.stderr
        stderr = stderr.stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith("error: "), stderr
    for text in expected:
        assert text in lines[0], stderr
    return lines[0]


def interrupted_at(stderr: str) -> int:
    """The update a stopped run says it saved at."""
    found = re.search(r"interrupted at update (\d+): saved checkpoint_last.pt", stderr)
    assert found, stderr
    return int(found.group(1))


needs_ct2 = pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                               reason="ctranslate2 is not installed (pip install -e '.[ct2]' in nmt's checkout)")


def train_tiny_checkpoint(data_dir, save_dir) -> Path:
    """transformer_tiny after 120 updates on the numbers task: words, not noise (a few seconds);
    the precision the machine chooses (auto), as a user's model would be trained."""
    from nmt.training.trainer import train

    train(load_train_config({"data": str(data_dir), "arch": "transformer_tiny", "save_dir": str(save_dir),
                             "max_tokens": 1000, "lr": 3e-3, "warmup_updates": 10, "max_update": 120,
                             "valid_subset": "none", "log_interval": 1000}))
    return Path(save_dir) / "checkpoint_last.pt"


def tiny_config(data_dir, save_dir, **options) -> TrainConfig:
    """transformer_tiny on the tiny numbers task: 300 pairs, 9 batches of <= 1000 tokens per epoch.

    On the CPU in fp32 unless a test asks otherwise: tests that compare numbers (resume, gradient
    accumulation, several processes) must not change with the machine's GPU or bf16 instructions."""
    values = {"data": str(data_dir), "arch": "transformer_tiny", "save_dir": str(save_dir), "max_tokens": 1000,
              "lr": 3e-3, "warmup_updates": 10, "log_interval": 5, "device": "cpu", "precision": "fp32"}
    values.update(options)
    return load_train_config(values)


def make_trainer(config: TrainConfig):
    """A single-process Trainer (not yet fitted), its inputs opened and checked as `nmt train` does."""
    from nmt.device import resolve_device
    from nmt.training.distributed import DistributedContext
    from nmt.training.inputs import check_inputs
    from nmt.training.trainer import Trainer

    device = resolve_device(config.compute.device)
    return Trainer(config, DistributedContext(), check_inputs(config, device), device)


def assert_same_weights(path_a, path_b) -> None:
    a, b = load_checkpoint(path_a), load_checkpoint(path_b)
    assert a["train_state"]["update"] == b["train_state"]["update"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for (key, state), other in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].values()):
        assert all(torch.equal(state[k], other[k]) for k in state), key
@contextlib.contextmanager
def logged_messages() -> Iterator[list[str]]:
    """The nmt logger's messages (INFO and up) while the block runs."""
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture()
def messages():
    """The nmt logger's messages during the test."""
    with logged_messages() as records:
        yield records


@pytest.fixture(params=["c", "torch"])
def search_path(request, monkeypatch) -> Iterator[TorchBackend]:
    """Run the test twice: with nmt's C kernels for the search's log-softmax and top-k (CPU), and with
    torch's operations (what a GPU runs, and a CPU with NMT_CPU_KERNELS=0 or no compiler). Models
    prepared for decoding choose theirs by NMT_CPU_KERNELS; the backend is given for toy models."""
    from nmt.backends.cpu_backend import CpuKernelsBackend
    from nmt.backends.kernel_build import built_kernels
    from nmt.backends.torch_backend import TORCH

    if request.param == "torch":
        monkeypatch.setenv("NMT_CPU_KERNELS", "0")
        yield TORCH
    else:
        kernels, why = built_kernels()
        if kernels is None:
            pytest.skip(f"nmt's CPU kernels could not be built here: {why}")
        yield CpuKernelsBackend(kernels)


both_search_paths = pytest.mark.usefixtures("search_path")
