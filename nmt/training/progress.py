"""What training shows: a rich progress bar per epoch, log lines, TensorBoard scalars, a summary table.

Losses are in nats per target token (natural log; fairseq logs base 2: divide by ln 2 = 0.693 to
compare); ``ppl`` is ``exp(nll)``, the perplexity of the model's unsmoothed predictions. Only
rank 0 shows anything.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from nmt.errors import NmtError
from nmt.log import logger, stderr_console
from nmt.training.metrics_file import MetricsFile


def perplexity(nll_per_token: float) -> float:
    return math.exp(min(nll_per_token, 100.0))


@dataclass
class StepResult:
    """What one update did: sums over its batches (this process's, or all processes' once agreed)."""

    loss: float  # label-smoothed loss, summed over target tokens (nats)
    nll: float
    tokens: float  # target tokens
    sentences: float
    grad_norm: float | None = None  # before clipping; None when no step was taken
    skipped: str | None = None  # why no optimizer step was taken: "fp16 overflow", "out of memory"


@dataclass
class Meter:
    """Sums over a stretch of updates, turned into per-token and per-second figures.

    Skipped updates (fp16 overflow) are counted apart and left out of the loss: their loss is
    that of weights that did not move.
    """

    loss: float = 0.0
    nll: float = 0.0
    tokens: float = 0.0
    sentences: float = 0.0
    updates: int = 0
    skipped: int = 0
    grad_norm: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def add(self, step: StepResult) -> None:
        if step.skipped is not None:
            self.skipped += 1
            return
        self.loss += step.loss
        self.nll += step.nll
        self.tokens += step.tokens
        self.sentences += step.sentences
        self.updates += 1
        self.grad_norm += step.grad_norm

    def figures(self) -> dict[str, float]:
        seconds = max(time.monotonic() - self.started, 1e-9)
        tokens = max(self.tokens, 1.0)
        return {"loss": self.loss / tokens, "nll": self.nll / tokens, "ppl": perplexity(self.nll / tokens),
                "gnorm": self.grad_norm / max(self.updates, 1), "tokens_per_second": self.tokens / seconds,
                "updates_per_second": self.updates / seconds, "skipped": self.skipped}


def format_figures(figures: dict[str, float], lr: float | None = None) -> str:
    parts = [f"loss {figures['loss']:.3f}", f"ppl {figures['ppl']:.2f}"]
    if "bleu" in figures:
        parts.append(f"bleu {figures['bleu']:.2f}")
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    if "tokens_per_second" in figures:
        parts += [f"{figures['tokens_per_second']:,.0f} tok/s", f"{figures['updates_per_second']:.2f} upd/s",
                  f"gnorm {figures['gnorm']:.2f}"]
    if figures.get("skipped"):
        parts.append(f"skipped {figures['skipped']}")
    return " | ".join(parts)


class Display:
    """Progress bar, periodic log lines and TensorBoard, for the main process."""

    def __init__(self, enabled: bool, show_bar: bool, tensorboard_dir: str | None,
                 metrics: MetricsFile | None = None):
        self.enabled = enabled
        self.metrics = metrics if enabled else None
        self.show_bar = enabled and show_bar and stderr_console.is_terminal
        self.progress: Progress | None = None
        self.task = None
        self.writer = None
        if enabled and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise NmtError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)") from None
            self.writer = SummaryWriter(tensorboard_dir)

    @contextlib.contextmanager
    def epoch(self, epoch: int, total: int, completed: int) -> Iterator[None]:
        if not self.show_bar:
            yield
            return
        self.progress = Progress(TextColumn(f"epoch {epoch}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[figures]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=stderr_console)
        self.task = self.progress.add_task("train", total=total, completed=completed, figures="")
        with self.progress:
            yield
        self.progress = None

    def advance(self, figures: dict[str, float], lr: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, figures=format_figures(figures, lr))

    def train_line(self, epoch: int, update: int, figures: dict[str, float], lr: float) -> None:
        if not self.enabled:
            return
        logger.info("epoch %d | update %d | %s", epoch, update, format_figures(figures, lr),
                    extra={"fields": {"kind": "train", "epoch": epoch, "update": update, "lr": lr, **figures}})
        self.scalars("train", update, {**figures, "lr": lr})
        self.record({"kind": "train", "epoch": epoch, "update": update, "lr": lr, **figures})

    def valid_line(self, subset: str, epoch: int, update: int, figures: dict[str, float],
                   best: tuple[str, float] | None) -> None:
        """One validation split's figures; ``best`` (--best-checkpoint-metric and its best value so far)
        only on the split that decides it."""
        if not self.enabled:
            return
        best_fields = {} if best is None else {f"best_{best[0]}": best[1]}
        logger.info("valid on '%s' | epoch %d | update %d | %s%s", subset, epoch, update, format_figures(figures),
                    "" if best is None else f" | best {best[0]} {best[1]:{'.2f' if best[0] == 'bleu' else '.3f'}}",
                    extra={"fields": {"kind": "valid", "subset": subset, "epoch": epoch, "update": update,
                                      **best_fields, **figures}})
        self.scalars(subset, update, figures)  # tensorboard: valid/loss, valid1/loss, ...
        self.record({"kind": "valid", "subset": subset, "epoch": epoch, "update": update, **figures})

    def record(self, fields: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.append({"time": round(time.time(), 3), **fields})

    def scalars(self, prefix: str, update: int, figures: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in figures.items():
                self.writer.add_scalar(f"{prefix}/{name}", value, update)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def summary_table(rows: dict[str, Any]) -> Table:
    table = Table(title="training summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for name, value in rows.items():
        table.add_row(name, value if isinstance(value, str) else f"{value:,}" if isinstance(value, int)
                      else "-" if value is None else f"{value:.3f}")
    return table
