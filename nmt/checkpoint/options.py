"""The options of ``nmt average`` (and a recipe's ``average:`` section), torch-free for the command line."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nmt.checkpoint.names import LAST, is_training_checkpoint_name
from nmt.errors import NmtError
from nmt.generation.options import CheckSearchOptions
from nmt.options import check_values


@dataclass(frozen=True)
class AverageOptions:
    """The options of ``nmt average`` (and a recipe's ``average:`` section, whose input is the save dir)."""

    inputs: list[str] = field(metadata={"path": True,
        "help": "A save dir (with --num-epoch-checkpoints/--num-update-checkpoints) or the checkpoint files to "
                "average.",
        "argument": True, "metavar": "INPUTS"})
    output: str = field(metadata={"path": True, "help": "Where to write the averaged model-only checkpoint.",
                                  "flags": ["--output", "-o"]})
    num_epoch_checkpoints: int | None = field(default=None, metadata={
        "help": "Average the last N checkpoint{epoch}.pt files of the save dir.", "min": 1})
    num_update_checkpoints: int | None = field(default=None, metadata={
        "help": "Average the last N checkpoint_{epoch}_{update}.pt files of the save dir.", "min": 1})
    epoch_share: float | None = field(default=None, metadata={
        "help": "Average the checkpoint{epoch}.pt files of the last SHARE of the run's epochs (e.g. 0.1: the last "
                "tenth, at least one), so that the window follows the run's length on a fast and a slow machine.",
        "above": 0.0, "max": 1.0})
    check_search: CheckSearchOptions = field(default_factory=CheckSearchOptions, metadata={
        "help": "The search the decoding check judges (a recipe's: its generate stage's).", "panel": "Decoding check"})

    def __post_init__(self) -> None:
        check_values(self)
        check_output_name(self.output, self.inputs)

    def selection(self) -> dict[str, int | float]:
        """The one way of picking a save dir's checkpoints that was given (empty: the inputs are files)."""
        return {name: value for name in SELECTIONS if (value := getattr(self, name)) is not None}


SELECTIONS = ("num_epoch_checkpoints", "num_update_checkpoints", "epoch_share")


def check_output_name(output: str | Path, inputs: list[str] | list[Path]) -> None:
    """The averaged model is model-only: in a save dir (one of the inputs, or a directory holding
    checkpoint_last.pt), under a training checkpoint's name, training would resume from it (losing
    the optimizer and update count) or prune it. A directory fails here, before the checkpoints are read."""
    output = Path(output)
    if output.is_dir():
        raise NmtError(f"cannot write {output}: it is a directory")
    folder = os.path.realpath(output.parent)
    in_save_dir = (output.parent / LAST).exists() or any(os.path.realpath(path) == folder for path in inputs)
    if in_save_dir and is_training_checkpoint_name(output.name):
        raise NmtError(f"--output {output} has the name of a training checkpoint of that save dir, which training "
                       "resumes from or prunes: name the averaged model another way, e.g. averaged.pt")
