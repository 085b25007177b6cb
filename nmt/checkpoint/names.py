"""The names of the checkpoint files of a save dir, and their order.

    checkpoint_last.pt              what a re-run resumes from
    checkpoint_best.pt              the lowest validation loss so far
    checkpoint{epoch}.pt            at the end of each epoch
    checkpoint_{epoch}_{update}.pt  every --save-interval-updates updates

Averaging selects the last epoch or update checkpoints by these names, and training prunes
them; checkpoint_last.pt and checkpoint_best.pt match neither numbered pattern.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from nmt.errors import NmtError

LAST = "checkpoint_last.pt"
BEST = "checkpoint_best.pt"
MEMBER = re.compile(r"model([1-9]\d*)")
NUMBERED = {"epoch": re.compile(r"checkpoint(\d+)\.pt"), "update": re.compile(r"checkpoint_(\d+)_(\d+)\.pt")}


def epoch_checkpoint_name(epoch: int) -> str:
    return f"checkpoint{epoch}.pt"


def update_checkpoint_name(epoch: int, update: int) -> str:
    return f"checkpoint_{epoch}_{update}.pt"


def is_training_checkpoint_name(name: str) -> bool:
    """A name the trainer writes, resumes from or prunes."""
    return name in (LAST, BEST) or any(pattern.fullmatch(name) for pattern in NUMBERED.values())


def numbered_checkpoints(directory: Path, kind: Literal["epoch", "update"]) -> list[Path]:
    """The epoch or update checkpoints of a save dir, oldest first: by epoch, or by update (then epoch)."""
    found = [(tuple(int(group) for group in match.groups())[::-1], path) for path in directory.iterdir()
             if (match := NUMBERED[kind].fullmatch(path.name))]
    return [path for _, path in sorted(found)]


def split_paths(path: str) -> list[str]:
    """``a.pt:b.pt`` (fairseq's spelling) -> the checkpoints to ensemble; a file that exists is one path."""
    if Path(path).exists():
        return [path]
    paths = path.split(":")
    if not all(paths):
        raise NmtError(f"--path {path!r} has an empty checkpoint name; write a.pt:b.pt")
    return paths


def member_dirs(save_dir: str | Path, models: int) -> list[Path]:
    """Where each of ``--models N`` models trained side by side keeps its checkpoints: the save dir
    itself for one model, else SAVE_DIR/model1 ... SAVE_DIR/modelN."""
    return [Path(save_dir)] if models == 1 else [Path(save_dir) / f"model{index}" for index in range(1, models + 1)]


def found_member_dirs(save_dir: Path) -> list[Path]:
    """The model directories (model1, model2, ...) that --models runs left in a save dir, whatever their number;
    a symlink to a directory is one (training writes through it)."""
    found = [(int(match.group(1)), path) for path in save_dir.iterdir()
             if (match := MEMBER.fullmatch(path.name)) and path.is_dir()]
    return [path for _, path in sorted(found)]


def member_files(path: str | Path, models: int) -> list[Path]:
    """A file made from each of ``models`` models (an average): PATH for one, DIR/modelK/NAME for several."""
    return [directory / Path(path).name for directory in member_dirs(Path(path).parent, models)]


def refuse_duplicates(paths: list[str] | list[Path], why: str = "") -> None:
    """One checkpoint given twice (by any spelling of its path) is a one-line error; ``why`` follows."""
    seen: dict[Path, str | Path] = {}
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in seen:
            raise NmtError(f"checkpoint given twice: {seen[resolved]} and {path}{why}")
        seen[resolved] = path
