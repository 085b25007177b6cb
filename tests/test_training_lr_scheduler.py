import math

import pytest
import torch

from nmt.errors import NmtError
from nmt.training.config import TrainConfig
from nmt.training.lr_scheduler import BudgetDecaySchedule, InverseSqrtSchedule, make_schedule, set_lr


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
    assert set_lr(schedule, optimizer, 5) == pytest.approx(5e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [pytest.approx(5e-4)] * 2


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_budget_decay_warms_up_to_the_peak_then_reaches_zero_at_the_end_of_max_update(kind):
    schedule = BudgetDecaySchedule(kind, warmup_updates=10, peak_lr=1e-3, max_update=100, max_seconds=None)
    assert schedule.lr_at(5) == pytest.approx(0.5e-3)  # warm-up, as the paper's
    assert schedule.lr_at(10) == schedule.lr_at(11) == pytest.approx(1e-3)  # the peak, then the decay starts
    assert schedule.lr_at(56) == pytest.approx(0.5e-3)  # half the 90 updates after the warm-up spent
    assert schedule.lr_at(100) == pytest.approx(1e-3 / 90 if kind == "linear" else
                                                1e-3 * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    lrs = [schedule.lr_at(step) for step in range(10, 101)]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] > 0.0  # decays monotonically; the last update still learns


def test_budget_decay_follows_the_share_of_max_time_spent_after_the_warm_up():
    schedule = BudgetDecaySchedule("linear", warmup_updates=1, peak_lr=2e-3, max_update=None, max_seconds=600.0)
    assert schedule.lr_at(7, elapsed=0.0) == pytest.approx(2e-3)
    assert schedule.lr_at(7, elapsed=150.0) == pytest.approx(1.5e-3)
    assert schedule.lr_at(7, elapsed=150.0, warmup_elapsed=100.0) == pytest.approx(1.8e-3)  # 50 of 500 s
    assert schedule.lr_at(7, elapsed=900.0) == 0.0  # past the budget: never negative
    both = BudgetDecaySchedule("linear", 1, 2e-3, max_update=1001, max_seconds=600.0)
    assert both.lr_at(502, elapsed=150.0) == pytest.approx(1e-3)  # the larger share: half the updates


def test_make_schedule_defaults_the_peak_to_the_papers_and_needs_a_budget():
    schedule = make_schedule("cosine", 4000, 512, None, max_update=100_000, max_seconds=None)
    assert schedule.lr_at(4000) == pytest.approx(InverseSqrtSchedule(4000, 512).lr_at(4000), rel=1e-12)
    assert isinstance(make_schedule("inverse_sqrt", 4000, 512, None, None, None), InverseSqrtSchedule)
    with pytest.raises(NmtError, match="give --max-update or --max-time"):
        TrainConfig(data="d", lr_schedule="linear", max_tokens=100)
    TrainConfig(data="d", lr_schedule="linear", max_tokens=100, max_time="10m")  # a budget: fine


def test_a_warmup_share_is_the_same_share_of_the_budget_on_a_fast_and_a_slow_machine():
    """10% of a 600-second budget is 60 s whatever the update count reached by then."""
    schedule = BudgetDecaySchedule("linear", 4000, peak_lr=1e-3, max_update=None, max_seconds=600.0, warmup_share=0.1)
    for step in (50, 5000):  # a slow and a fast machine, 30 s in: half-way up the warm-up
        assert schedule.lr_at(step, elapsed=30.0) == pytest.approx(0.5e-3)
    assert schedule.lr_at(9999, elapsed=60.0) == pytest.approx(1e-3)  # the peak at 10%
    assert schedule.lr_at(9999, elapsed=330.0) == pytest.approx(0.5e-3)  # half of the other 90% spent
    assert schedule.lr_at(9999, elapsed=600.0) == 0.0
    by_updates = BudgetDecaySchedule("cosine", 4000, 1e-3, max_update=1000, max_seconds=None, warmup_share=0.2)
    assert by_updates.lr_at(100) == pytest.approx(0.5e-3) and by_updates.lr_at(200) == pytest.approx(1e-3)
    assert by_updates.lr_at(600) == pytest.approx(0.5e-3)  # the cosine's middle


def test_a_warmup_share_needs_a_budget_decay():
    with pytest.raises(NmtError, match="--warmup-share is a share of the budget"):
        TrainConfig(data="d", warmup_share=0.1, max_tokens=100, max_time="10m")
    TrainConfig(data="d", warmup_share=0.1, lr_schedule="cosine", max_tokens=100, max_time="10m")
