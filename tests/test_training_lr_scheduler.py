import math

import pytest
import torch

from nmt.training.lr_scheduler import InverseSqrtSchedule


@pytest.mark.parametrize("step", [1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000])
def test_paper_formula(step):
    schedule = InverseSqrtSchedule(warmup_updates=4000, d_model=512)
    expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
    assert schedule.lr_at(step) == pytest.approx(expected, rel=1e-12)


def test_paper_values_by_hand():
    schedule = InverseSqrtSchedule(4000, 512)
    assert schedule.lr_at(4000) == pytest.approx(6.987712429686844e-04)  # the peak: 1 / sqrt(512 * 4000)
    assert schedule.lr_at(2000) == pytest.approx(schedule.lr_at(4000) / 2)  # linear warm-up
    assert schedule.lr_at(16000) == pytest.approx(schedule.lr_at(4000) / 2)  # inverse square root after


@pytest.mark.parametrize("step,expected", [(1, 7e-4 / 4000), (2000, 3.5e-4), (4000, 7e-4), (16000, 3.5e-4),
                                           (64000, 1.75e-4)])
def test_peak_form(step, expected):
    assert InverseSqrtSchedule(4000, 512, peak_lr=7e-4).lr_at(step) == pytest.approx(expected, rel=1e-12)


def test_both_forms_agree_when_the_peak_is_the_papers():
    paper = InverseSqrtSchedule(4000, 512)
    peak = InverseSqrtSchedule(4000, 512, peak_lr=1 / math.sqrt(512 * 4000))
    for step in (1, 7, 500, 4000, 4001, 12345, 10 ** 6):
        assert peak.lr_at(step) == pytest.approx(paper.lr_at(step), rel=1e-9)


def test_set_lr_writes_every_param_group():
    optimizer = torch.optim.AdamW([{"params": [torch.zeros(1, requires_grad=True)]},
                                   {"params": [torch.zeros(1, requires_grad=True)]}], lr=1.0)
    schedule = InverseSqrtSchedule(10, 64, peak_lr=1e-3)
    assert schedule.set_lr(optimizer, 5) == pytest.approx(5e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [pytest.approx(5e-4)] * 2
