"""Checkpoint averaging: the mean of the parameters of the last N checkpoints of a run.

The paper averages the last 5 (base) or 20 (big) checkpoints. Checkpoints are read one at a
time into a float64 running sum, so memory stays at one sum plus one checkpoint. The result is
a model-only checkpoint (no optimizer state) that loads like any other. `nmt average` then checks
which fast decoding settings keep its BLEU (nmt/training/decoding_check.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt.checkpoint.format import check_compatible, load_checkpoint, make_checkpoint, save_checkpoint
from nmt.checkpoint.names import NUMBERED, numbered_checkpoints, refuse_duplicates
from nmt.checkpoint.options import check_output_name
from nmt.errors import NmtError
from nmt.files import refuse_overwriting
from nmt.log import logger


def last_checkpoints(directory: str | Path, num_epoch_checkpoints: int | None = None,
                     num_update_checkpoints: int | None = None, epoch_share: float | None = None) -> list[Path]:
    """The last N epoch or update checkpoints of a save dir, oldest first, ordered by number; or the
    epoch checkpoints of the last ``epoch_share`` of the run's epochs (the newest epoch's number)."""
    directory = Path(directory)
    if sum(value is not None for value in (num_epoch_checkpoints, num_update_checkpoints, epoch_share)) != 1:
        raise NmtError("give exactly one of --num-epoch-checkpoints, --num-update-checkpoints and --epoch-share")
    if not directory.is_dir():
        raise NmtError(f"not a directory: {directory}")
    if epoch_share is not None:
        return epoch_share_checkpoints(directory, epoch_share)
    kind, count = ("epoch", num_epoch_checkpoints) if num_epoch_checkpoints is not None else \
        ("update", num_update_checkpoints)
    if count < 1:
        raise NmtError(f"--num-{kind}-checkpoints must be at least 1, got {count}")
    found = numbered_checkpoints(directory, kind)
    if len(found) < count:
        names = ", ".join(path.name for path in found) or "none"
        raise NmtError(f"asked for the last {count} {kind} checkpoints but {directory} has {len(found)} ({names})")
    return found[-count:]


def epoch_share_checkpoints(directory: Path, share: float) -> list[Path]:
    """The epoch checkpoints of the last ``share`` of the run: of E epochs, the last round(share * E)
    (at least one), every one of which must still be in the save dir."""
    if not 0.0 < share <= 1.0:
        raise NmtError(f"--epoch-share must be in (0, 1], got {share}")
    found = numbered_checkpoints(directory, "epoch")
    if not found:
        raise NmtError(f"{directory} has no epoch checkpoints (checkpoint{{epoch}}.pt) to average")
    epochs = int(NUMBERED["epoch"].fullmatch(found[-1].name)[1])
    count = max(1, round(share * epochs))
    if len(found) < count:
        raise NmtError(f"--epoch-share {share} of {epochs} epochs is the last {count} epoch checkpoints but "
                       f"{directory} keeps {len(found)} (train with a larger --keep-last-epochs)")
    logger.info("--epoch-share %s of %d epochs: the last %d epoch checkpoints", share, epochs, count)
    return found[-count:]


def _aliases(state: dict[str, Tensor]) -> dict[str, str]:
    """Map each key that shares its tensor with an earlier key (tied embeddings) to that key."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for key, tensor in state.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tensor.stride(), tensor.dtype)
        if identity in seen:
            aliases[key] = seen[identity]
        else:
            seen[identity] = key
    return aliases


def average_checkpoints(paths: list[str | Path]) -> dict[str, Any]:
    """A model-only checkpoint whose float tensors are the mean over ``paths``.

    Float tensors are summed in float64 and cast back to their dtype; integer buffers come from
    the last checkpoint. Tied weights stay one tensor in the result.
    """
    paths = [Path(path) for path in paths]
    if not paths:
        raise NmtError("no checkpoints to average")
    refuse_duplicates(paths)

    first: dict[str, Any] | None = None
    sums: dict[str, Tensor] = {}  # float64 running sums of the float tensors
    integers: dict[str, Tensor] = {}  # integer buffers, from the last checkpoint
    dtypes: dict[str, torch.dtype] = {}
    for path in paths:
        logger.info("reading %s", path)
        checkpoint = load_checkpoint(path, mmap=True, verify=("model", "vocab"))  # the optimizer state is never read
        state = checkpoint["model"]
        layout = {key: (tuple(tensor.shape), tensor.is_floating_point()) for key, tensor in state.items()}
        if first is None:
            first = {key: checkpoint[key] for key in ("model_name", "arch", "model_config", "vocab")}
            first_layout, aliases = layout, _aliases(state)
        else:
            check_compatible(first, checkpoint, f"cannot average {paths[0]} and {path}")  # their values in that order
            if layout != first_layout:
                changed = sorted(set(layout.items()) ^ set(first_layout.items()))
                raise NmtError(f"cannot average {paths[0]} and {path}: their weights differ "
                               f"(first difference at {changed[0][0]!r})")
        for key, tensor in state.items():
            if key in aliases:
                continue
            if not tensor.is_floating_point():
                integers[key] = tensor.clone()
            elif key in sums:
                sums[key] += tensor
            else:
                sums[key] = tensor.to(torch.float64, copy=True)
        dtypes = {key: tensor.dtype for key, tensor in state.items()}
        del checkpoint, state  # only the sums outlive this checkpoint

    averaged: dict[str, Tensor] = {}
    for key, dtype in dtypes.items():
        if key in aliases:
            averaged[key] = averaged[aliases[key]]
        elif key in integers:
            averaged[key] = integers[key]
        else:
            averaged[key] = sums.pop(key).div_(len(paths)).to(dtype)
    return make_checkpoint(first["model_name"], first["arch"], first["model_config"], first["vocab"], averaged,
                           averaged_from=[str(path) for path in paths])


def average(inputs: list[str | Path], output: str | Path, num_epoch_checkpoints: int | None = None,
            num_update_checkpoints: int | None = None, epoch_share: float | None = None) -> list[Path]:
    """`nmt average`: pick the inputs (a save dir plus a count, or explicit files), average, save.

    Returns the checkpoints that were averaged, oldest first.
    """
    inputs = [Path(path) for path in inputs]
    if not inputs:
        raise NmtError("give a save dir or checkpoint files to average")
    if any(value is not None for value in (num_epoch_checkpoints, num_update_checkpoints, epoch_share)):
        if len(inputs) != 1 or not inputs[0].is_dir():
            found = "" if len(inputs) != 1 or inputs[0].exists() else " (no such directory)"
            raise NmtError("--num-epoch-checkpoints/--num-update-checkpoints/--epoch-share need exactly one save dir "
                           f"as input, got {', '.join(map(str, inputs))}{found}")
        paths = last_checkpoints(inputs[0], num_epoch_checkpoints, num_update_checkpoints, epoch_share)
    else:
        for path in inputs:
            if path.is_dir():
                raise NmtError(f"{path} is a directory: add --num-epoch-checkpoints N, --num-update-checkpoints N "
                               "or --epoch-share S to pick its last checkpoints")
        paths = inputs
    output = Path(output)
    check_output_name(output, inputs)
    refuse_overwriting("--output", output, {"input": paths})
    save_checkpoint(output, average_checkpoints(paths))
    logger.info("averaged %d checkpoint(s) (%s) into %s", len(paths), ", ".join(path.name for path in paths), output)
    return paths
