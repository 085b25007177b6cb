"""Ensembles decode with the renormalized mean of their models' log-probabilities."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_data_dir, numbers_pairs
from test_translator import tiny_checkpoint

from nmt.checkpoint.format import load_checkpoint, model_from_checkpoint
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import BOS_ID, Vocabulary
from nmt.generation.ensemble import Ensemble
from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
from nmt.generation.options import SearchOptions
from nmt.scoring import score
from nmt.training.config import load_train_config
from nmt.training.trainer import train

OPTIONS = SearchOptions(beam=3, nbest=3, max_len_b=8)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    pairs = numbers_pairs(400, seed=3)
    return make_data_dir(tmp_path_factory.mktemp("ensemble-data"), {"train": pairs[:360], "test": pairs[360:]})


@pytest.fixture(scope="module")
def trained_pair(data_dir, tmp_path_factory) -> list[Path]:
    """Two transformer_tiny models trained from different seeds (a few epochs of the numbers task)."""
    root = tmp_path_factory.mktemp("ensemble-models")
    paths = []
    for seed in (1, 2):
        config = load_train_config({"data": str(data_dir), "arch": "transformer_tiny",
                                    "save_dir": str(root / str(seed)), "max_tokens": 1000, "lr": 5e-3,
                                    "warmup_updates": 20, "seed": seed, "max_epoch": 12, "valid_subset": None,
                                    "log_interval": 1000})
        train(config)
        paths.append(root / str(seed) / "checkpoint_last.pt")
    return paths


def source_arrays(data_dir) -> list[np.ndarray]:
    split = DataDir.open(data_dir).split("test")
    return [split.source[i] for i in range(len(split))]


def tokens(hypotheses) -> list[list[list[int]]]:
    return [[h.tokens for h in hyps] for hyps in hypotheses]


def test_an_ensemble_of_one_model_is_that_model(data_dir, tmp_path):
    checkpoint = tiny_checkpoint(tmp_path / "a.pt", DataDir.open(data_dir).vocabulary("en"))
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    sources = source_arrays(data_dir)
    alone, ensembled = (translate_ids(m, sources, TranslationRequest(OPTIONS)) for m in (model, Ensemble([model])))
    assert tokens(ensembled) == tokens(alone)
    for a, b in zip(alone, ensembled):
        for h, g in zip(a, b):
            assert g.score == pytest.approx(h.score, abs=1e-4)
            assert g.positional_scores == pytest.approx(h.positional_scores, abs=1e-4)


def test_decode_returns_normalized_log_probabilities_at_least_the_models_mean(trained_pair, data_dir):
    models = [model_from_checkpoint(load_checkpoint(path))[0].eval() for path in trained_pair]
    ensemble = Ensemble(models)
    split = DataDir.open(data_dir).split("test")
    source = torch.as_tensor(split.source[0])[None]
    target = torch.as_tensor(split.target[0])[None]
    prev = torch.cat([torch.tensor([[BOS_ID]]), target[:, :-1]], dim=1)
    with torch.no_grad():
        logprobs = ensemble.decode(prev, ensemble.encode(source))
        members = torch.stack([m.decode(prev, m.encode(source)).log_softmax(-1) for m in models])
    assert torch.allclose(logprobs.logsumexp(-1), torch.zeros(()), atol=1e-5)
    assert torch.allclose(logprobs.log_softmax(-1), logprobs, atol=1e-5)  # search's log_softmax changes nothing
    assert torch.all(logprobs >= members.mean(0) - 1e-5)  # Z <= 1: the geometric mean, renormalized
    assert not torch.allclose(logprobs, members[0], atol=1e-3) and not torch.allclose(logprobs, members[1], atol=1e-3)


def test_a_trained_pair_scores_at_least_as_well_as_the_worse_model(trained_pair, data_dir):
    vocab = DataDir.open(data_dir).vocabulary("de")
    split = DataDir.open(data_dir).split("test")
    references = [vocab.decode(split.target[i]) for i in range(len(split))]
    options = SearchOptions(beam=4)

    def translate(path: str) -> tuple[list[str], float]:
        model, _ = prepare_model(path, torch.device("cpu"))
        found = translate_ids(model, source_arrays(data_dir), TranslationRequest(options))
        best = [vocab.decode(hyps[0].tokens) for hyps in found]
        return best, score(best, [references])[0].score

    (first, first_bleu), (second, second_bleu) = translate(str(trained_pair[0])), translate(str(trained_pair[1]))
    both, both_bleu = translate(f"{trained_pair[0]}:{trained_pair[1]}")
    assert min(first_bleu, second_bleu) > 5  # the models learned something: the comparison means something
    assert both != first and both != second
    assert both_bleu >= min(first_bleu, second_bleu)


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nmt", "generate", "-i", "-", "--max-len-b", "5", *args],
                          input="five\nthe number four\nTurn to page twelve.\n", capture_output=True, text=True)


def test_cli_spellings_and_vocabulary_mismatch(data_dir, tmp_path):
    vocab = DataDir.open(data_dir).vocabulary("en")
    a, b = tiny_checkpoint(tmp_path / "a.pt", vocab, seed=0), tiny_checkpoint(tmp_path / "b.pt", vocab, seed=1)
    colon, repeated, alone = generate("--path", f"{a}:{b}"), generate("--path", str(a), "--path", str(b)), \
        generate("--path", str(a))
    assert colon.returncode == 0 and colon.stdout == repeated.stdout and colon.stdout != alone.stdout
    other = tiny_checkpoint(tmp_path / "other.pt", Vocabulary.train(
        [side for pair in numbers_pairs(300, seed=5) for side in pair], vocab_size=100))
    mismatch = generate("--path", f"{a}:{other}")
    assert mismatch.returncode == 1 and mismatch.stdout == ""
    assert mismatch.stderr == f"error: cannot ensemble {other} with {a}: their vocabularies or languages differ\n"
    empty = generate("--path", f"{a}:")
    assert empty.returncode == 1 and "empty checkpoint name" in empty.stderr
    twice = generate("--path", f"{a}:{tmp_path}/./a.pt")
    assert twice.returncode == 1 and twice.stderr.startswith(f"error: checkpoint given twice: {a} and ")
    assert twice.stderr.endswith("(an ensemble of a model with itself decodes as the model alone, at twice the cost)\n")
