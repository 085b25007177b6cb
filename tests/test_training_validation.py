"""Which validation is the best: by loss (default) or by BLEU; it makes checkpoint_best.pt and --patience."""

from __future__ import annotations

import re

import pytest

from nmt.checkpoint import load_checkpoint
from nmt.errors import NmtError
from nmt.training.trainer import TrainState, train
from nmt.training.validation import record_validation

from conftest import tiny_config

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
    assert best["update"] == 9 * (bleus.index(max(bleus)) + 1)  # saved at the epoch of the best BLEU
