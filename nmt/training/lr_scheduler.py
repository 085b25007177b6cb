"""Learning-rate schedules: the paper's inverse square root (in its form and fairseq's), and decays to 0 over a budget.

Paper (section 5.3): ``lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``: linear warm-up
for ``warmup`` steps, then decay with the inverse square root of the step.

fairseq's ``--lr`` form names the peak instead: ``lr = peak * step / warmup`` during warm-up,
then ``peak * sqrt(warmup / step)``. The two are the same curve when
``peak = d_model^-0.5 * warmup^-0.5`` (7.0e-4 for transformer_base with 4000 warm-up steps).

``step`` counts updates from 1: the first update uses ``lr_at(1)``. The schedules have no state
of their own: they are functions of the update count and the training time, which checkpoints hold.

``BudgetDecaySchedule`` warms up the same way to the peak, then anneals from it to zero at the end
of the training budget (linearly or along a half cosine), as fairseq's ``polynomial_decay`` and
``cosine`` do over a fixed number of updates. Its budget can also be ``--max-time``: the share of
the time after the warm-up spent so far then says where on the curve an update is, so a
time-limited run ends annealed whatever the machine's speed (and is not bit-exact across a
resume, as the update count it reaches is not). With ``--warmup-share`` the warm-up, too, is a
share of the budget rather than a number of updates: 800 updates are 40% of two hours on one
machine and 7% on another; 10% of the budget is 10% on both.
"""

from __future__ import annotations

import math
from typing import Protocol

from torch.optim import Optimizer


class Schedule(Protocol):
    def lr_at(self, step: int, elapsed: float = 0.0, warmup_elapsed: float = 0.0) -> float: ...


def set_lr(schedule: Schedule, optimizer: Optimizer, step: int, elapsed: float = 0.0,
           warmup_elapsed: float = 0.0) -> float:
    """Set the learning rate for update number ``step`` and return it; ``elapsed``: the training
    seconds before it, ``warmup_elapsed``: those the warm-up took (for a time-budgeted decay)."""
    lr = schedule.lr_at(step, elapsed, warmup_elapsed)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def make_schedule(kind: str, warmup_updates: int, d_model: int, peak_lr: float | None,
                  max_update: int | None, max_seconds: float | None, warmup_share: float = 0.0) -> Schedule:
    """The schedule ``--lr-schedule`` names; without ``--lr``, the peak is the paper's for this d_model."""
    if kind == "inverse_sqrt":
        return InverseSqrtSchedule(warmup_updates, d_model, peak_lr)
    peak = peak_lr if peak_lr is not None else d_model ** -0.5 * warmup_updates ** -0.5
    return BudgetDecaySchedule(kind, warmup_updates, peak, max_update, max_seconds, warmup_share)


class InverseSqrtSchedule:
    def __init__(self, warmup_updates: int, d_model: int, peak_lr: float | None = None):
        if warmup_updates < 1:
            raise ValueError("warmup_updates must be at least 1")
        self.warmup_updates = warmup_updates
        self.d_model = d_model
        self.peak_lr = peak_lr

    def lr_at(self, step: int, elapsed: float = 0.0, warmup_elapsed: float = 0.0) -> float:
        step = max(step, 1)
        if self.peak_lr is None:
            return self.d_model ** -0.5 * min(step ** -0.5, step * self.warmup_updates ** -1.5)
        if step < self.warmup_updates:
            return self.peak_lr * step / self.warmup_updates
        return self.peak_lr * math.sqrt(self.warmup_updates / step)


class BudgetDecaySchedule:
    """Linear warm-up to ``peak``, then ``peak * decay(spent)``: ``spent`` is the share of the budget
    after the warm-up used before this update (of ``max_update`` updates or ``max_seconds`` of
    training, the larger share when both are set); decay is ``1 - spent`` (linear) or
    ``(1 + cos(pi * spent)) / 2`` (cosine). A ``warmup_share`` above 0 replaces ``warmup_updates``:
    the warm-up is then that share of the budget, measured the same way."""

    def __init__(self, kind: str, warmup_updates: int, peak_lr: float, max_update: int | None,
                 max_seconds: float | None, warmup_share: float = 0.0):
        if kind not in ("linear", "cosine"):
            raise ValueError(f"unknown decay {kind!r}")
        if not max_update and not max_seconds:  # TrainConfig refuses this with a one-line error first
            raise ValueError(f"a {kind} decay needs max_update or max_seconds")
        if not 0.0 <= warmup_share < 1.0:
            raise ValueError(f"warmup_share must be in [0, 1), got {warmup_share}")
        self.kind, self.warmup_updates, self.peak_lr = kind, warmup_updates, peak_lr
        self.max_update, self.max_seconds, self.warmup_share = max_update, max_seconds, warmup_share

    def spent(self, step: int, elapsed: float, warmup_elapsed: float) -> float:
        shares = [0.0]
        if self.max_update:
            shares.append((step - 1 - self.warmup_updates) / max(self.max_update - self.warmup_updates, 1))
        if self.max_seconds:
            shares.append((elapsed - warmup_elapsed) / max(self.max_seconds - warmup_elapsed, 1e-9))
        return min(max(shares), 1.0)

    def share_used(self, step: int, elapsed: float) -> float:
        """The share of the whole budget used up to this update (the larger of updates and time)."""
        shares = [step / self.max_update] if self.max_update else []
        if self.max_seconds:
            shares.append(elapsed / self.max_seconds)
        return min(max(shares), 1.0)

    def lr_at(self, step: int, elapsed: float = 0.0, warmup_elapsed: float = 0.0) -> float:
        step = max(step, 1)
        if self.warmup_share:
            used = self.share_used(step, elapsed)
            if used < self.warmup_share:
                return self.peak_lr * used / self.warmup_share
            return self.peak_lr * self.decay((used - self.warmup_share) / (1.0 - self.warmup_share))
        if step <= self.warmup_updates:
            return self.peak_lr * step / self.warmup_updates
        return self.peak_lr * self.decay(self.spent(step, elapsed, warmup_elapsed))

    def decay(self, spent: float) -> float:
        return 1.0 - spent if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * spent))
