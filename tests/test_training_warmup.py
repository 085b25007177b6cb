"""A run whose update limits end it inside (or just after) its warm-up says so when it starts."""

from __future__ import annotations

import re

import pytest
from conftest import tiny_config

from nmt.training.trainer import train, warmup_warning


@pytest.mark.parametrize(("options", "expected"), [
    ({"max_epoch": 30, "warmup_updates": 4000}, "stops at 3,600 updates (--max-epoch 30 x 120 updates per epoch), "
                                                "inside its 4,000-update warm-up"),
    ({"max_update": 5000, "warmup_updates": 4000}, "stops at 5,000 updates (--max-update 5000), just after"),
    ({"max_update": 5000, "max_epoch": 30, "warmup_updates": 4000}, "stops at 3,600 updates (--max-epoch 30"),
])
def test_a_run_cut_off_by_its_warmup_is_told(tiny_data_dir, tmp_path, options, expected):
    warning = warmup_warning(tiny_config(tiny_data_dir, tmp_path, **options), updates_per_epoch=120)
    assert warning is not None and expected in warning
    assert "--warmup-updates 360" in warning or "--warmup-updates 500" in warning  # a tenth of the run


@pytest.mark.parametrize("options", [
    {"max_epoch": 30, "warmup_updates": 1800},  # the warm-up is half the run: fine
    {"max_time": "2h", "warmup_updates": 4000},  # a time limit says nothing of the updates
    {"max_update": 8000, "max_epoch": 100, "warmup_updates": 4000},
    {"max_update": 3000, "warmup_updates": 4000, "warmup_share": 0.1, "lr_schedule": "cosine"},  # a share of the run
])
def test_a_run_well_past_its_warmup_is_not_warned(tiny_data_dir, tmp_path, options):
    assert warmup_warning(tiny_config(tiny_data_dir, tmp_path, **options), updates_per_epoch=120) is None


def test_train_logs_the_warning(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_epoch=1, warmup_updates=100, check_decoding=False))
    assert any("stops at 9 updates (--max-epoch 1 x 9 updates per epoch), inside its 100-update warm-up" in m
               for m in messages)


def test_a_run_that_ended_inside_its_warmup_is_told_at_its_end(tiny_data_dir, tmp_path, messages):
    """A time limit cannot be judged at the start: the end says so."""
    train(tiny_config(tiny_data_dir, tmp_path, max_time="2s", warmup_updates=1_000_000, check_decoding=False))
    assert sum("inside its 1,000,000-update warm-up" in m for m in messages) == 1
    assert any(re.search(r"training ended at update [\d,]+ \(reached --max-time 2s\), inside its", m)
               for m in messages)
    messages.clear()
    train(tiny_config(tiny_data_dir, tmp_path / "past", max_update=3, warmup_updates=2, check_decoding=False))
    assert not any("inside its" in m for m in messages)


def test_a_run_warned_at_its_start_is_not_warned_again_at_its_end(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=3, warmup_updates=100, check_decoding=False))
    assert [m for m in messages if "warm-up" in m] == [next(m for m in messages if "stops at 3 updates" in m)]
