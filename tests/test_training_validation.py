"""Which validation is the best: by loss (default) or by BLEU; it makes checkpoint_best.pt and --patience."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from conftest import make_data_dir, numbers_pairs, tiny_config

from nmt.checkpoint.format import load_checkpoint
from nmt.data.dataset import DataDir
from nmt.errors import NmtError
from nmt.training.inputs import check_inputs
from nmt.training.state import TrainState
from nmt.training.trainer import train
from nmt.training.validation import record_validation

CPU = torch.device("cpu")

# Loss and BLEU disagree: the loss keeps falling while BLEU peaks at the second validation.
FIGURES = [{"loss": 5.0, "bleu": 10.0}, {"loss": 4.0, "bleu": 30.0}, {"loss": 3.0, "bleu": 20.0},
           {"loss": 2.0, "bleu": 25.0}]


def replay(metric: str) -> tuple[list[bool], TrainState]:
    state = TrainState()
    return [record_validation(state, figures, metric) for figures in FIGURES], state


def test_loss_decides_by_default_and_bleu_when_asked():
    improved, state = replay("loss")
    assert improved == [True, True, True, True] and state.bad_validations == 0 and state.best_valid_loss == 2.0
    improved, state = replay("bleu")
    assert improved == [True, True, False, False] and state.bad_validations == 2
    assert state.best_valid_bleu == 30.0 and state.best_valid_loss == 2.0  # the best loss is still tracked


def test_bleu_metric_needs_eval_bleu(tiny_data_dir, tmp_path):
    with pytest.raises(NmtError, match="--best-checkpoint-metric bleu needs --eval-bleu"):
        tiny_config(tiny_data_dir, tmp_path, best_checkpoint_metric="bleu")
    with pytest.raises(NmtError, match="best_checkpoint_metric must be one of loss, bleu"):
        tiny_config(tiny_data_dir, tmp_path, best_checkpoint_metric="chrf")


def test_checkpoint_best_holds_the_best_bleu(tiny_data_dir, tmp_path, messages):  # noqa: F811
    summary = train(tiny_config(tiny_data_dir, tmp_path, max_epoch=3, eval_bleu=True, best_checkpoint_metric="bleu"))
    bleus = [float(re.search(r"\| bleu ([\d.]+)", m)[1]) for m in messages if m.startswith("valid on")]
    assert len(bleus) == 3 and summary.epoch == 3
    best = load_checkpoint(tmp_path / "checkpoint_best.pt")["train_state"]
    assert best["best_valid_bleu"] == pytest.approx(max(bleus), abs=0.01)
    # Unrounded (two BLEUs the log shows alike may differ below its 0.01): the first of the best
    exact = [r["bleu"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "valid"]
    assert best["best_valid_bleu"] == max(exact)
    assert best["update"] == 9 * (exact.index(max(exact)) + 1)  # saved at the epoch of the best BLEU
    shown = [float(re.search(r"\| best bleu ([\d.]+)$", m)[1]) for m in messages if m.startswith("valid on")]
    assert shown == [max(bleus[:n]) for n in (1, 2, 3)]  # the metric that decides, not the loss


def test_bleu_with_batches_of_sentences_only(tiny_data_dir, tmp_path, messages):  # noqa: F811
    """--max-sentences without --max-tokens: validation BLEU decodes batches of that many sentences."""
    train(tiny_config(tiny_data_dir, tmp_path, max_epoch=1, eval_bleu=True, max_tokens=None, max_sentences=16))
    assert [m for m in messages if m.startswith("valid on") and "| bleu " in m]


def test_a_valid_pair_over_the_models_positions_fails_before_training(tmp_path):
    pairs = numbers_pairs(60, seed=3)
    long_pair = (" ".join(source for source, _ in pairs[:8]), " ".join(target for _, target in pairs[:8]))
    data = make_data_dir(tmp_path / "data", {"train": pairs[:50], "valid": [*pairs[50:], long_pair]})
    train_longest = int(max(np.maximum(DataDir.open(data).split("train").source.sizes,
                                       DataDir.open(data).split("train").target.sizes)))
    config = tiny_config(data, tmp_path / "run", model={"max_positions": train_longest})
    with pytest.raises(NmtError, match="valid pair 10 has .* over the model's max_positions"):
        check_inputs(config, CPU)
    skipping = check_inputs(dataclasses.replace(config, skip_invalid_size_inputs=True), CPU)
    validated = sorted(np.concatenate(skipping.valid[0].batches).tolist())
    assert validated == skipping.valid[0].pairs.tolist() == list(range(10))  # all but the long pair
    assert len(np.concatenate(skipping.train[0].batches.epoch(1, 1))) == 50  # every training pair fits
    # --eval-bleu translates the same pairs the loss is computed on (the long one would fail the search)
    summary = train(dataclasses.replace(config, skip_invalid_size_inputs=True, eval_bleu=True, max_epoch=1))
    assert summary.valid_bleu is not None


def test_a_missing_bleu_tokenizer_fails_before_training(tmp_path):
    try:
        import MeCab  # noqa: F401
        pytest.skip("MeCab is installed: ja-mecab works")
    except ImportError:
        pass
    pairs = numbers_pairs(60, seed=3)
    data = make_data_dir(tmp_path / "data", {"train": pairs[:50], "valid": pairs[50:]}, target_lang="ja")
    config = tiny_config(data, tmp_path / "run", eval_bleu=True)
    with pytest.raises(NmtError, match="BLEU tokenizer ja-mecab needs extra packages"):
        check_inputs(config, CPU)
    check_inputs(dataclasses.replace(config, eval_bleu_tokenize="char"), CPU)


@pytest.mark.slow
def test_several_validation_splits_are_each_reported_and_the_first_decides(tmp_path):
    pairs = numbers_pairs(130, seed=5)
    data = make_data_dir(tmp_path / "data", {"train": pairs[:100], "valid": pairs[100:110], "valid1": pairs[110:]})
    summary = train(tiny_config(data, tmp_path / "run", max_epoch=2, valid_subset="valid,valid1"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [(r["subset"], r["epoch"]) for r in records if r["kind"] == "valid"]
    assert valid == [("valid", 1), ("valid1", 1), ("valid", 2), ("valid1", 2)]
    losses = {subset: r["loss"] for r in records if r["kind"] == "valid" and r["epoch"] == 2
              for subset in [r["subset"]]}
    assert losses["valid"] != losses["valid1"] and summary.valid_loss == losses["valid"]
    best = load_checkpoint(tmp_path / "run" / "checkpoint_best.pt")["train_state"]["best_valid_loss"]
    assert best == min(r["loss"] for r in records if r["kind"] == "valid" and r["subset"] == "valid")
    with pytest.raises(NmtError, match="has no split 'dev' to validate on"):
        check_inputs(tiny_config(data, tmp_path / "other", valid_subset="valid,dev"), CPU)
