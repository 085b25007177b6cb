"""Training's checkpoint policy for its save dir: holding it, writing, pruning, resuming.

The file names are nmt/checkpoint/names.py's. Each file is a full, independent ``torch.save``
written atomically (nmt.checkpoint.save_checkpoint);
none is a copy of another, so no crash leaves a half-written one. A training checkpoint adds to
the model state: optimizer, scaler, rng (torch/cuda/python), train_state (epoch,
position in the epoch, update, validation bookkeeping) and train_config (the resolved recipe).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from nmt.checkpoint.format import load_checkpoint, model_only, save_checkpoint
from nmt.checkpoint.names import BEST, LAST, epoch_checkpoint_name, numbered_checkpoints, update_checkpoint_name
from nmt.errors import NmtError
from nmt.files import cannot_write, lock_directory, lock_holder, remove_stale, temp_file_pattern, unlock_directory
from nmt.log import logger


@contextlib.contextmanager
def claim_save_dir(save_dir: Path) -> Iterator[None]:
    """Make the save dir and hold its lock while training; remove temp files of interrupted saves.

    A second ``nmt train`` on the same save dir would mix its checkpoints with this run's (and a
    later average would mix two runs), so it fails at once, naming this process.
    """
    if save_dir.exists() and not save_dir.is_dir():
        raise NmtError(f"--save-dir {save_dir} is a file, not a directory")
    created = [directory for directory in (save_dir, *save_dir.parents) if not directory.exists()]
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cannot_write(save_dir, exc) from exc
    if not lock_directory(save_dir):
        raise NmtError(f"{save_dir} is in use by another `nmt train` ({lock_holder(save_dir)}); "
                       "wait for it to finish or give another --save-dir")
    try:
        remove_stale([*save_dir.glob(temp_file_pattern("checkpoint*.pt")), *save_dir.glob(temp_file_pattern("*.yaml"))],
                     "temp file(s)")
        yield
    finally:
        unlock_directory(save_dir)
        for directory in created:  # a run that failed before writing anything leaves no empty save dir behind
            with contextlib.suppress(OSError):  # not empty: the run wrote something, which stays
                directory.rmdir()


def checkpoint_names(save_interval_updates: int, epoch: int, update: int, stepped: bool, improved: bool = False,
                     epoch_end: bool = False, stopping: bool = False) -> list[str]:
    """The files an update writes: at an epoch's end, every --save-interval-updates, on a new best
    validation, and checkpoint_last.pt whenever anything is saved or training stops."""
    names = [epoch_checkpoint_name(epoch)] if epoch_end else []
    if stepped and save_interval_updates and update % save_interval_updates == 0:
        names.append(update_checkpoint_name(epoch, update))
    if improved:
        names.append(BEST)
    if names or stopping:
        names.append(LAST)
    return names


def write_checkpoints(save_dir: Path, checkpoint: dict[str, Any], names: list[str]) -> None:
    """Write the checkpoint under each name, checkpoint_last.pt last (it is what a resume trusts)."""
    for name in sorted(names, key=lambda name: name == LAST):
        save_checkpoint(save_dir / name, checkpoint)
    logger.debug("saved %s", ", ".join(names))


def prune_checkpoints(save_dir: Path, keep_last_epochs: int, keep_interval_updates: int) -> None:
    """Delete all but the newest N epoch / update checkpoints (N < 0 keeps all)."""
    for kind, keep in (("epoch", keep_last_epochs), ("update", keep_interval_updates)):
        if keep < 0:
            continue
        found = numbered_checkpoints(save_dir, kind)
        for path in found[: max(len(found) - keep, 0)]:
            path.unlink(missing_ok=True)
            logger.debug("removed %s", path.name)


def rng_state() -> dict[str, Any]:
    """Random generator states as tensors and plain types (torch.load runs with weights_only)."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": [version, list(internal), gauss]}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


class ResumePoint(NamedTuple):
    path: Path
    checkpoint: dict[str, Any]
    in_save_dir: bool  # continuing the save dir's own run (not a --restore-file)


def find_resume_checkpoint(save_dir: Path, restore_file: str | None,
                           finetune_from_model: str | None = None) -> ResumePoint | None:
    """The checkpoint to start from: save_dir's checkpoint_last.pt, else --restore-file, else the
    weights of --finetune-from-model (a model-only checkpoint: a new run), else None.

    A checkpoint_last.pt that does not load (truncated, corrupt) is reported and the newest
    training checkpoint of the save dir that does load is used instead. Other checkpoints without a
    checkpoint_last.pt are an earlier run's: refused unless --restore-file says where to go on from.
    """
    last = save_dir / LAST
    if not last.exists():
        earlier = sorted(save_dir.glob("checkpoint*.pt"), key=lambda path: path.stat().st_mtime, reverse=True)
        if earlier and restore_file is None:  # a new run would write over them
            shown = ", ".join(path.name for path in earlier[:3]) + (" ..." if len(earlier) > 3 else "")
            raise NmtError(f"--save-dir {save_dir} holds checkpoints of an earlier run ({shown}) but no {LAST}: "
                           f"continue it with --restore-file {earlier[0]}, or give another --save-dir")
        given, flag = (restore_file, "--restore-file") if restore_file is not None else \
            (finetune_from_model, "--finetune-from-model")
        if given is None:
            return None
        path = Path(given)
        if not path.exists() and (save_dir / given).exists():
            path = save_dir / given
        if not path.exists():
            raise NmtError(f"{flag} not found: {given}")
        checkpoint = load_checkpoint(path)
        if finetune_from_model is not None:
            checkpoint = model_only(checkpoint)
        return ResumePoint(path, checkpoint, in_save_dir=False)
    try:
        return ResumePoint(last, load_checkpoint(last), in_save_dir=True)
    except NmtError as exc:
        logger.warning("%s; looking for the newest checkpoint in %s that loads", exc, save_dir)
    others = sorted((p for p in save_dir.glob("checkpoint*.pt") if p.name != LAST),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for path in others:
        try:
            checkpoint = load_checkpoint(path)
        except NmtError as exc:
            logger.warning("%s", exc)
            continue
        if "train_state" in checkpoint:
            logger.warning("resuming from %s instead of the broken %s", path.name, LAST)
            return ResumePoint(path, checkpoint, in_save_dir=True)
    raise NmtError(f"{last} does not load and no other checkpoint in {save_dir} does; "
                   "move the save dir away to start over")
