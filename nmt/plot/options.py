"""The options of `nmt plot attention` and `nmt plot curves`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nmt.errors import NmtError
from nmt.files import refuse_overwriting
from nmt.options import check_values
from nmt.training.metrics_file import FILE_NAME as METRICS_FILE

IMAGE_KINDS = ("png", "pdf", "svg")


def image_kind(output: str) -> str:
    return Path(output).suffix.lstrip(".").lower()


def check_image_kind(output: str) -> None:
    """The image format follows --output's suffix (a .pdf holding PNG bytes opens nowhere)."""
    if image_kind(output) not in IMAGE_KINDS:
        raise NmtError(f"--output {output}: name a .png, .pdf or .svg file (the suffix picks the format)")


@dataclass(frozen=True)
class PlotAttentionOptions:
    path: str = field(metadata={"path": True, "help": "Checkpoint whose attention to draw."})
    text: str = field(metadata={"help": "Source sentence (raw text)."})
    output: str = field(default="attention.png", metadata={
        "path": True, "help": "Image to write; its suffix says which kind: .png, .pdf or .svg.",
        "flags": ["--output", "-o"]})
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
        check_image_kind(self.output)


@dataclass(frozen=True)
class PlotCurvesOptions:
    save_dir: str = field(metadata={"path": True, "help": "Training save dir holding metrics.jsonl.", "argument": True,
                                    "metavar": "SAVE_DIR"})
    output: str = field(default="curves.png", metadata={
        "path": True, "help": "Image to write; its suffix says which kind: .png, .pdf or .svg.",
        "flags": ["--output", "-o"]})

    def __post_init__(self) -> None:
        refuse_overwriting("--output", self.output, {"training metrics": Path(self.save_dir) / METRICS_FILE})
        check_image_kind(self.output)

