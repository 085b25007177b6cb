"""Where a training run stands: the one record a checkpoint keeps as ``train_state``, read by the
trainer (the loop, resume, the stop decision) and by validation (the best figures, --patience)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint as ``train_state``."""

    epoch: int = 1  # the epoch in progress (or next to start)
    position: int = 0  # global batches of that epoch already trained on
    update: int = 0  # optimizer steps taken
    best_valid_loss: float | None = None
    best_valid_bleu: float | None = None  # with --eval-bleu
    bad_validations: int = 0  # validations since the best one (for --patience)
    elapsed: float = 0.0  # training seconds over all runs (for --max-time)
    warmup_elapsed: float = 0.0  # training seconds when the warm-up ended (for a time-budgeted decay)
