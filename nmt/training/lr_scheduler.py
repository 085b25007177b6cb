"""The inverse square-root learning-rate schedule, in the paper's form and in fairseq's.

Paper (section 5.3): ``lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``: linear warm-up
for ``warmup`` steps, then decay with the inverse square root of the step.

fairseq's ``--lr`` form names the peak instead: ``lr = peak * step / warmup`` during warm-up,
then ``peak * sqrt(warmup / step)``. The two are the same curve when
``peak = d_model^-0.5 * warmup^-0.5`` (7.0e-4 for transformer_base with 4000 warm-up steps).

``step`` counts updates from 1: the first update uses ``lr_at(1)``. The schedule has no state of
its own: it is a function of the update count, which checkpoints hold.
"""

from __future__ import annotations

import math
from torch.optim import Optimizer


class InverseSqrtSchedule:
    def __init__(self, warmup_updates: int, d_model: int, peak_lr: float | None = None):
        if warmup_updates < 1:
            raise ValueError("warmup_updates must be at least 1")
        self.warmup_updates = warmup_updates
        self.d_model = d_model
        self.peak_lr = peak_lr

    def lr_at(self, step: int) -> float:
        step = max(step, 1)
        if self.peak_lr is None:
            return self.d_model ** -0.5 * min(step ** -0.5, step * self.warmup_updates ** -1.5)
        if step < self.warmup_updates:
            return self.peak_lr * step / self.warmup_updates
        return self.peak_lr * math.sqrt(self.warmup_updates / step)

    def set_lr(self, optimizer: Optimizer, step: int) -> float:
        """Set the learning rate for update number ``step`` and return it."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
