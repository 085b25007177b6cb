"""The checkpoint file: assembled in one place, saved atomically with checksums, loaded with checks,
compared, and turned back into a model from the file alone.

A checkpoint is a dict saved with ``torch.save``. Every checkpoint holds at least::

    nmt_version, model_name, arch, model_config (dict of the resolved dataclass),
    vocab: {source_lang, target_lang, source: bytes, target: bytes}  (sentencepiece protos)
    model: state_dict

Training checkpoints add optimizer, scaler, rng and train_state entries; a checkpoint whose decoding
was checked on its validation set (`nmt average`, training's end: nmt/training/decoding_check.py)
adds ``decoding``: {quantize, stop, reason}, read by ``--quantize auto`` and ``--stop auto``
(nmt/generation/decoding_settings.py; older checkpoints have none and decode as before).
``save_checkpoint`` adds ``checksums`` (a CRC-32 of each entry's tensors and byte strings), which
``load_checkpoint`` verifies and removes.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from nmt.data.vocabulary import PAD_ID, Vocabularies
from nmt.errors import NmtError
from nmt.files import atomic_write, signals_held
from nmt.models.registry import build_model, config_from_dict
from nmt.version import __version__

MODEL_KEYS = ("nmt_version", "model_name", "arch", "model_config", "vocab", "model")  # a model-only checkpoint
REQUIRED_KEYS = MODEL_KEYS[1:]  # files written before nmt_version was recorded lack it


def make_checkpoint(model_name: str, arch: str, model_config: dict[str, Any], vocab: dict[str, Any],
                    model: dict[str, torch.Tensor], **extra: Any) -> dict[str, Any]:
    """The one place a checkpoint dict is assembled: the MODEL_KEYS entries, then ``extra`` (training
    state or provenance)."""
    values = (__version__, model_name, arch, model_config, vocab, model)
    return {**dict(zip(MODEL_KEYS, values)), **extra}


def model_only(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint without what training or averaging added to its model: what a model-only file holds."""
    return {key: checkpoint[key] for key in MODEL_KEYS if key in checkpoint}


def model_state(model: nn.Module, arch: str, config: Any, vocabs: Vocabularies, **extra: Any) -> dict[str, Any]:
    """A checkpoint of a model: what `generate` and `average` need (plus ``extra``)."""
    return make_checkpoint(model.model_name, arch, dataclasses.asdict(config), vocabs.to_state(), model.state_dict(),
                           **extra)


def stored_data(value: Any, name: str = "") -> Iterator[tuple[str, memoryview]]:
    """The tensors and byte strings (vocabularies) inside nested dicts/lists/tuples, as bytes with a
    path-like name that also records a tensor's dtype and shape, in a fixed order."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        yield f"{name}:{value.dtype}:{tuple(value.shape)}", memoryview(data)
    elif isinstance(value, bytes):
        yield name, memoryview(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from stored_data(item, f"{name}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from stored_data(item, f"{name}/{index}")


def checksum(value: Any) -> int:
    """CRC-32 of the tensors and byte strings in ``value``, with their names.

    torch.load notices a broken zip structure but not flipped bytes inside a tensor; this does.
    """
    crc = 0
    for name, data in stored_data(value):
        crc = zlib.crc32(data, zlib.crc32(name.encode(), crc))
    return crc


def save_checkpoint(path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    """Write atomically, with a checksum of each entry's tensors and bytes (``checksums``) for load to verify."""
    sums = {key: checksum(value) for key, value in checkpoint.items() if key != "checksums"}
    with signals_held(), atomic_write(path, "wb") as handle:  # a Ctrl-C during the write acts after it
        torch.save({**checkpoint, "checksums": sums}, handle)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                    mmap: bool = False, verify: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Load and check a checkpoint: the file must unpickle safely and its tensors match their checksums.

    ``verify`` names the entries whose checksums are checked (default: all). ``mmap=True`` maps
    the tensors from the file instead of reading them: entries never touched (a training
    checkpoint's optimizer state, when averaging) cost no memory. Checkpoints written before
    checksums existed load unverified.
    """
    path = Path(path)
    if not path.exists():
        raise NmtError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise NmtError(f"expected a checkpoint file, got a directory: {path}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EIO):
            raise NmtError(f"cannot read {path}: {exc.strerror}") from exc
        raise NmtError(f"{path} is corrupt or not an nmt checkpoint") from exc  # torch's EINVAL on a short file
    except Exception as exc:  # torch raises many types here; its text advises weights_only=False, which we never want
        raise NmtError(f"{path} is corrupt or not an nmt checkpoint") from exc
    if not isinstance(checkpoint, dict) or any(key not in checkpoint for key in REQUIRED_KEYS):
        raise NmtError(f"{path} is corrupt or not an nmt checkpoint")
    stored = checkpoint.pop("checksums", {})
    for key in stored if verify is None else verify:
        if key in stored and checksum(checkpoint.get(key)) != stored[key]:
            raise NmtError(f"{path} is corrupt: its {key!r} entry does not match its checksum")
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


DROPOUTS = ("dropout", "attention_dropout", "activation_dropout")  # training settings: no weight depends on them


def weights_config(config: dict[str, Any]) -> dict[str, Any]:
    """A model config without its dropouts: what two checkpoints must share to hold the same weights
    (fine-tuning or resuming with another dropout is common, and fairseq allows it)."""
    return {key: value for key, value in config.items() if key not in DROPOUTS}


def check_compatible(found: dict[str, Any], expected: dict[str, Any], context: str, model_remedy: str = "") -> None:
    """Refuse checkpoint ``found`` when it holds another model, language pair or vocabulary than
    ``expected`` (a checkpoint too): ``{context}: different ...``, and for another model ``; {model_remedy}``."""
    remedy = f"; {model_remedy}" if model_remedy else ""
    a, b = (weights_config(c["model_config"]) for c in (found, expected))
    if found["model_name"] != expected["model_name"] or a != b:
        differences = [f"{key} {a.get(key)!r} vs {b.get(key)!r}" for key in sorted(set(a) | set(b))
                       if a.get(key) != b.get(key)]
        raise NmtError(f"{context}: different models ({describe(found)} vs {describe(expected)}"
                       f"{': ' if differences else ''}{', '.join(differences[:3])}){remedy}")
    pairs = [f"{c['vocab']['source_lang']}->{c['vocab']['target_lang']}" for c in (found, expected)]
    if pairs[0] != pairs[1]:
        raise NmtError(f"{context}: different language pairs ({pairs[0]} vs {pairs[1]})")
    for side in ("source", "target"):
        if found["vocab"][side] != expected["vocab"][side]:
            raise NmtError(f"{context}: different {side} vocabularies")
