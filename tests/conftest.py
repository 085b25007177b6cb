"""Shared fixtures: tiny binarized data directories built without `nmt preprocess`."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from nmt.data.dataset import DataDir, write_token_array
from nmt.data.vocabulary import EOS_ID, Vocabulary
from nmt.demo_data import demo_pairs, sample_numbers
from nmt.log import logger

# One intra-op thread for the tests and the commands they start: tiny models gain nothing from
# more, and on a machine whose cores are busy with other work, OpenMP threads waiting for each
# other made single steps 10-40x slower (measured on the 2-core development VM).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
    DataDir(directory, {"source_lang": source_lang, "target_lang": target_lang,
                        "splits": {split: {"sentences": len(pairs)} for split, pairs in splits.items()},
                        "vocab_files": {source_lang: "spm.model", target_lang: "spm.model"},
                        "joint": True}).write_meta()
    return directory


def numbers_pairs(count: int, seed: int, max_number: int = 9_999) -> list[tuple[str, str]]:
    """English -> German numbers-in-words sentences (nmt.demo_data), short enough for tiny tests."""
    return demo_pairs(sample_numbers(count, seed, max_number), seed)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """300 training and 40 validation EN->DE pairs of the numbers task; vocabulary of 120 pieces."""
    pairs = numbers_pairs(340, seed=0)
    return make_data_dir(tmp_path_factory.mktemp("tiny-data"), {"train": pairs[:300], "valid": pairs[300:]})


@pytest.fixture()
def messages():
    """The nmt logger's messages during the test."""
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)
