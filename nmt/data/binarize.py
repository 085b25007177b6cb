"""One split streamed into token files: read and checked in chunks of pairs, encoded while the next
chunk is read, filtered (train only) and appended to a ``TokenFileWriter`` per side."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import sentencepiece as spm

from nmt.data.corpus import SplitFiles, read_chunks
from nmt.data.dataset import smallest_dtype
from nmt.data.meta import SplitMeta
from nmt.data.summary import format_dropped
from nmt.data.token_file import TokenFileWriter
from nmt.data.vocabulary import EOS_ID, UNK_ID, Vocabularies, Vocabulary
from nmt.errors import NmtError
from nmt.parallel import ordered_map


class BinarizeSettings(Protocol):
    """What binarizing reads of PreprocessOptions."""

    max_len: int
    max_len_ratio: float
    workers: int


@dataclass(frozen=True)
class Sampling:
    """How one sampled segmentation of the training text is drawn: sentencepiece's ``alpha`` and a
    seed, so that preprocessing the same text again writes the same samples."""

    alpha: float
    seed: int


@dataclass
class EncodedSide:
    """One side of a chunk as flat token ids (no EOS yet) and per-sentence lengths."""

    tokens: np.ndarray
    lengths: np.ndarray


def encode_lines(vocab: Vocabulary, lines: list[str], threads: int = 1, sampling_alpha: float = 0.0) -> EncodedSide:
    """Encode straight into a compact numpy array (Python lists of ids would take ~20x the RAM)."""
    ids = vocab.encode_batch(lines, num_threads=threads, sampling_alpha=sampling_alpha)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(chain.from_iterable(ids), dtype=smallest_dtype(len(vocab)), count=int(lengths.sum()))
    return EncodedSide(tokens, lengths)


def encoded_chunks(split: SplitFiles, vocabs: tuple[Vocabulary, Vocabulary], workers: int, chunk_lines: int,
                   sampling: Sampling | None = None) -> Iterator[tuple[EncodedSide, EncodedSide]]:
    """The split's chunks of pairs, read and checked here and encoded by sentencepiece's own
    ``workers`` threads in a second thread, so the next chunk is read while one is encoded (no
    processes: the text and the ids never have to be copied between them)."""

    def encode(numbered: tuple[int, tuple[list[str], list[str]]]) -> tuple[EncodedSide, EncodedSide]:
        number, chunk = numbered
        sides = []
        for side, (vocab, lines) in enumerate(zip(vocabs, chunk)):
            if sampling:  # a thread seeds its generator when it starts: one thread, so the seed alone decides
                spm.set_random_generator_seed((sampling.seed * 1_000_003 + 2 * number + side) % 2**31)
                sides.append(encode_lines(vocab, lines, 1, sampling.alpha))
            else:
                sides.append(encode_lines(vocab, lines, workers))
        return sides[0], sides[1]

    yield from ordered_map(encode, enumerate(read_chunks(split, chunk_lines)), threads=1, ahead=2)


def drop_reasons(source_lengths: np.ndarray, target_lengths: np.ndarray, max_len: int,
                 max_len_ratio: float) -> dict[str, np.ndarray]:
    """Masks of the training pairs to drop, each pair under its first reason only."""
    source_sizes, target_sizes = source_lengths + 1, target_lengths + 1  # as stored, with EOS
    empty = (source_lengths == 0) | (target_lengths == 0)
    never = np.zeros_like(empty)
    too_long = ~empty & ((source_sizes > max_len) | (target_sizes > max_len)) if max_len else never
    longer, shorter = np.maximum(source_sizes, target_sizes), np.minimum(source_sizes, target_sizes)
    ratio = ~empty & ~too_long & (longer > max_len_ratio * shorter) if max_len_ratio else never
    return {"empty": empty, "too_long": too_long, "ratio": ratio}


def with_eos(side: EncodedSide, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept sentences as stored: flat tokens each followed by EOS, and their sizes (EOS included)."""
    sizes = side.lengths[keep] + 1
    ends = np.cumsum(sizes)
    tokens = np.full(int(ends[-1]) if len(ends) else 0, EOS_ID, dtype=side.tokens.dtype)
    body = np.ones(len(tokens), dtype=bool)
    body[ends - 1] = False
    tokens[body] = side.tokens[np.repeat(keep, side.lengths)]
    return tokens, sizes


def binarize_split(workdir: Path, split: SplitFiles, vocabs: Vocabularies, settings: BinarizeSettings,
                   advance: Callable[[int], None], chunk_lines: int, sampling: Sampling | None = None,
                   name: str | None = None) -> SplitMeta:
    """Stream one split: read, check, encode, filter (train only) and write it as ``name`` (default:
    the split's); return its meta.json entry. ``sampling`` writes a sampled segmentation instead of the best."""
    sides = ((vocabs.source_lang, vocabs.source), (vocabs.target_lang, vocabs.target))
    writers = [TokenFileWriter(workdir / f"{name or split.name}.{lang}", smallest_dtype(len(vocab)))
               for lang, vocab in sides]
    unknown = [0, 0]
    dropped = dict.fromkeys(("empty", "too_long", "ratio"), 0)
    input_lines = 0
    try:
        for chunk in encoded_chunks(split, (vocabs.source, vocabs.target), settings.workers, chunk_lines, sampling):
            keep = np.ones(len(chunk[0].lengths), dtype=bool)
            if not split.keeps_every_line:
                reasons = drop_reasons(chunk[0].lengths, chunk[1].lengths, settings.max_len, settings.max_len_ratio)
                for reason, mask in reasons.items():
                    keep &= ~mask
                    dropped[reason] += int(mask.sum())
            for i, (writer, side) in enumerate(zip(writers, chunk)):
                tokens, sizes = with_eos(side, keep)
                writer.append(tokens, sizes)
                unknown[i] += int(np.count_nonzero(tokens == UNK_ID))
            input_lines += len(keep)
            advance(len(keep))
    except BaseException:
        for writer in writers:
            writer.handle.close()  # the caller deletes the workdir
        raise
    for writer in writers:
        writer.close()
    entry = SplitMeta(sentences=writers[0].num_sentences, input_lines=input_lines,
                      source_file=str(split.source.resolve()), target_file=str(split.target.resolve()),  # any cwd
                      dropped=None if split.keeps_every_line else dropped,
                      source_tokens=writers[0].num_tokens, source_unk=unknown[0],
                      target_tokens=writers[1].num_tokens, target_unk=unknown[1])
    if entry.dropped is not None and entry.sentences == 0:
        raise NmtError(f"all training pairs were dropped ({format_dropped(dropped)}); "
                       "check --max-len and --max-len-ratio")
    return entry
