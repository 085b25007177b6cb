"""The options of `nmt plot attention` and `nmt plot curves`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nmt.files import refuse_overwriting
from nmt.options import check_values
from nmt.training.metrics_file import FILE_NAME as METRICS_FILE


@dataclass(frozen=True)
class PlotAttentionOptions:
    path: str = field(metadata={"path": True, "help": "Checkpoint whose attention to draw."})
    text: str = field(metadata={"help": "Source sentence (raw text)."})
    output: str = field(default="attention.png", metadata={
        "path": True, "help": "PNG file to write.", "flags": ["--output", "-o"]})
    kind: Literal["encoder", "cross"] = field(default="encoder", metadata={
        "help": "encoder: the source's self-attention; cross: the translation's attention to the source."})
    layer: int | None = field(default=None, metadata={
        "help": "Layer, counted from 1 at the bottom; unset: the penultimate, as in the paper's figures.",
        "min": 1})
    head: int | None = field(default=None, metadata={"help": "One head, counted from 1; unset: every head.",
                                                     "min": 1})

    def __post_init__(self) -> None:
        check_values(self)
        refuse_overwriting("--output", self.output, {"--path": self.path})


@dataclass(frozen=True)
class PlotCurvesOptions:
    save_dir: str = field(metadata={"path": True, "help": "Training save dir holding metrics.jsonl.", "argument": True,
                                    "metavar": "SAVE_DIR"})
    output: str = field(default="curves.png", metadata={
        "path": True, "help": "PNG file to write.", "flags": ["--output", "-o"]})

    def __post_init__(self) -> None:
        refuse_overwriting("--output", self.output, {"training metrics": Path(self.save_dir) / METRICS_FILE})

