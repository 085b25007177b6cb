"""Binarized datasets: one memory-mapped flat token array per split and language plus offsets.

Layout of a data directory written by ``nmt preprocess``::

    meta.json                      written last: its presence marks the directory complete
    spm.model | spm.{lang}.model   the sentencepiece model(s)
    {split}.{lang}.tokens.npy      all sentences' token ids (each ending in EOS), concatenated
    {split}.{lang}.offsets.npy     int64, n+1 offsets into tokens
    shortlist.npz                  the vocabulary shortlist learned from train (nmt/data/shortlist.py)
    train.sample{k}.{lang}.*.npy   with --subword-samples: train segmented anew by sampling, k = 1, 2, ...

Splits are train, valid, valid1, ..., test, test1, ...; meta.json is described in nmt/data/meta.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmt.data.meta import DatasetMeta
from nmt.data.shortlist import Shortlist
from nmt.data.vocabulary import Vocabularies, Vocabulary
from nmt.errors import NmtError
from nmt.files import atomic_write


def smallest_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def write_token_array(prefix: str | os.PathLike, sentences: list[list[int]], vocab_size: int) -> None:
    """Write ``{prefix}.tokens.npy`` and ``{prefix}.offsets.npy`` atomically."""
    lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
    offsets = np.zeros(len(sentences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=smallest_dtype(vocab_size))
    for sentence, start, end in zip(sentences, offsets[:-1], offsets[1:]):
        tokens[start:end] = sentence
    save_token_array(prefix, tokens, offsets)


def save_token_array(prefix: str | os.PathLike, tokens: np.ndarray, offsets: np.ndarray) -> None:
    """Write already flat ``tokens`` and their n+1 ``offsets`` as ``{prefix}.{tokens,offsets}.npy``."""
    for suffix, array in (("tokens", tokens), ("offsets", offsets.astype(np.int64, copy=False))):
        with atomic_write(f"{prefix}.{suffix}.npy", "wb") as handle:
            np.save(handle, array)


class TokenArray:
    """Sentences of one split and language, read lazily from memory maps.

    Only ``sizes`` is read into memory: 4 bytes a sentence (a 36M-sentence corpus: 144 MB a side).
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = prefix
        try:
            self.tokens = np.load(f"{prefix}.tokens.npy", mmap_mode="r")
            self.offsets = np.load(f"{prefix}.offsets.npy", mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise NmtError(f"cannot read binarized data {prefix}.*.npy: {exc}") from exc
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[-1] != len(self.tokens):
            raise NmtError(f"binarized data {prefix} is inconsistent (offsets do not match tokens)")
        self.sizes = np.diff(self.offsets).astype(np.int32)

    def __len__(self) -> int:
        return len(self.sizes)

    def __reduce__(self) -> tuple[type, tuple[str | os.PathLike]]:
        """Sent to another process (the --nproc workers) as its path: the receiver maps the files itself."""
        return TokenArray, (self.prefix,)

    def __getitem__(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[index]:self.offsets[index + 1]], dtype=np.int64)


@dataclass
class ParallelDataset:
    source: TokenArray
    target: TokenArray

    def __post_init__(self) -> None:
        if len(self.source) != len(self.target):
            raise NmtError(f"source has {len(self.source)} sentences but target has {len(self.target)}")

    def __len__(self) -> int:
        return len(self.source)


@dataclass
class DataDir:
    """A finished ``nmt preprocess`` output directory."""

    path: Path
    meta: DatasetMeta

    @classmethod
    def open(cls, path: str | os.PathLike) -> "DataDir":
        path = Path(path)
        if not path.is_dir():
            raise NmtError(f"data directory not found: {path}")
        return cls(path, DatasetMeta.load(path))

    @property
    def source_lang(self) -> str:
        return self.meta.source_lang

    @property
    def target_lang(self) -> str:
        return self.meta.target_lang

    @property
    def splits(self) -> list[str]:
        return list(self.meta.splits)

    def vocabulary(self, lang: str) -> Vocabulary:
        return Vocabulary.load(self.path / self.meta.vocab_files[lang])

    def vocabularies(self) -> Vocabularies:
        """With the shortlist, where preprocess made one (data directories from before have none)."""
        source, target = self.vocabulary(self.source_lang), self.vocabulary(self.target_lang)
        shortlist = Shortlist.load(self.path / self.meta.shortlist_file, len(source), len(target)) \
            if self.meta.shortlist_file else None
        return Vocabularies(self.source_lang, self.target_lang, source, target, shortlist)

    def split(self, name: str) -> ParallelDataset:
        if name not in self.meta.splits:
            raise NmtError(f"{self.path} has no split {name!r}; it has: {', '.join(self.splits)}")
        return self._pairs(name)

    def samples(self, name: str) -> list[ParallelDataset]:
        """The sampled segmentations of split ``name`` (preprocess --subword-samples), in order; [] if none."""
        names = [sample_name(name, k) for k in range(1, len(self.meta.samples) + 1)]
        return [self._pairs(sample) for sample in names if sample in self.meta.samples]

    def _pairs(self, name: str) -> ParallelDataset:
        return ParallelDataset(TokenArray(self.path / f"{name}.{self.source_lang}"),
                               TokenArray(self.path / f"{name}.{self.target_lang}"))


def sample_name(split: str, number: int) -> str:
    """The files' name of a split's ``number``-th sampled segmentation (from 1)."""
    return f"{split}.sample{number}"
