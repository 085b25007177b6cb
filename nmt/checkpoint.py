"""Checkpoint files: atomic save, checked load, and rebuilding a model from one alone.

A checkpoint is a dict saved with ``torch.save``. Every checkpoint holds at least::

    nmt_version, model_name, arch, model_config (dict of the resolved dataclass),
    vocab: {source_lang, target_lang, source: bytes, target: bytes}  (sentencepiece protos)
    model: state_dict

Training checkpoints add optimizer, scheduler, scaler, rng and train_state entries.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nmt
from nmt.data.vocabulary import PAD_ID, Vocabulary
from nmt.errors import NmtError
from nmt.files import atomic_write
from nmt.models.registry import build_model, config_from_dict

REQUIRED_KEYS = ("model_name", "arch", "model_config", "vocab", "model")


@dataclass
class Vocabularies:
    source_lang: str
    target_lang: str
    source: Vocabulary
    target: Vocabulary

    @property
    def joint(self) -> bool:
        return self.source == self.target

    def to_state(self) -> dict[str, Any]:
        return {"source_lang": self.source_lang, "target_lang": self.target_lang,
                "source": self.source.model_proto, "target": self.target.model_proto}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Vocabularies":
        return cls(state["source_lang"], state["target_lang"], Vocabulary(state["source"]), Vocabulary(state["target"]))


def model_state(model: nn.Module, arch: str, config: Any, vocabs: Vocabularies) -> dict[str, Any]:
    """The part of a checkpoint that `generate` and `average` need."""
    return {
        "nmt_version": nmt.__version__,
        "model_name": model.model_name,
        "arch": arch,
        "model_config": dataclasses.asdict(config),
        "vocab": vocabs.to_state(),
        "model": model.state_dict(),
    }


def save_checkpoint(path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    with atomic_write(path, "wb") as handle:
        torch.save(checkpoint, handle)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                    mmap: bool = False) -> dict[str, Any]:
    """``mmap=True`` maps the tensors from the file instead of reading them: entries never
    touched (a training checkpoint's optimizer state, when averaging) cost no memory."""
    path = Path(path)
    if not path.exists():
        raise NmtError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise NmtError(f"expected a checkpoint file, got a directory: {path}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NmtError(f"checkpoint {path} is corrupt or truncated ({reason})") from exc
    if not isinstance(checkpoint, dict) or any(key not in checkpoint for key in REQUIRED_KEYS):
        raise NmtError(f"{path} is not an nmt checkpoint")
    return checkpoint


def model_from_checkpoint(checkpoint: dict[str, Any]) -> tuple[nn.Module, Vocabularies]:
    """Rebuild the model exactly as trained, from the checkpoint alone."""
    config = config_from_dict(checkpoint["model_name"], checkpoint["model_config"])
    vocabs = Vocabularies.from_state(checkpoint["vocab"])
    model = build_model(checkpoint["model_name"], config, len(vocabs.source), len(vocabs.target), PAD_ID)
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as exc:
        raise NmtError(f"checkpoint weights do not match arch {checkpoint['arch']!r}: "
                       f"{str(exc).splitlines()[0]}") from exc
    return model, vocabs


def describe(checkpoint: dict[str, Any]) -> str:
    return f"{checkpoint['arch']} ({checkpoint['model_name']})"
