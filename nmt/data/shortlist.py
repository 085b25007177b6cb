"""A vocabulary shortlist (Marian's lexical shortlist, CTranslate2's vocabulary map): for each source
piece, the target pieces it most likely translates to, plus the most frequent target pieces.

Decoding then scores only the candidates of a sentence's own pieces instead of the whole target
vocabulary: the output projection, log_softmax and top-k shrink with it (nmt/generation/candidates.py).

It is learned by ``nmt preprocess`` from the binarized training split with a few EM iterations of
IBM model 1 (Brown et al., 1993): p(t | s) is the share of the target pieces' alignment mass
each source piece ``s`` (or the sentence's NULL word) takes, so a frequent target piece that
co-occurs with everything ("the", ".") is explained by the pieces that cause it rather than
listed for all of them (plain co-occurrence counts would do that). The ``FREQUENT`` most frequent
target pieces are candidates for every sentence; each source piece adds its ``PER_PIECE``
likeliest others and, with a joint vocabulary, itself, so that names, numbers and characters seen
only in the input can be copied. A corpus with more than ``MAX_LINKS`` (source, target) piece
pairs is learned from a seeded random sample of its sentences that holds that many.

Saved as ``shortlist.npz`` in the data directory and carried in checkpoints next to the
vocabularies (as these bytes), so a checkpoint alone can use it.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from nmt.errors import NmtError
from nmt.files import atomic_write

SHORTLIST_FILE = "shortlist.npz"
PER_PIECE = 50  # target candidates kept per source piece
FREQUENT = 100  # target pieces that are candidates for every sentence
MAX_LINKS = 8_000_000  # (source piece, target piece) pairs learned from, at most: ~60 bytes each at the peak
ITERATIONS = 3  # of IBM model 1's EM; the first one gives fractional co-occurrence counts
SAMPLE_SEED = 1


@dataclass(frozen=True, eq=False)
class Shortlist:
    """Each source piece's target candidates and the candidates of every sentence, as target ids."""

    translations: np.ndarray  # (source vocabulary, k): likeliest first, padded with 0 (PAD, always a candidate)
    frequent: np.ndarray  # (FREQUENT,) most frequent first
    target_size: int  # of the target vocabulary

    def candidates(self, sources: list[np.ndarray]) -> np.ndarray:
        """(sentences, target_size) bool: the target ids that are candidates for each sentence of
        source ids, the frequent pieces and its pieces' translations (the special tokens are the
        caller's to add)."""
        chosen = np.zeros((len(sources), self.target_size), dtype=bool)
        rows = np.repeat(np.arange(len(sources)), [len(source) for source in sources])
        chosen[rows[:, None], self.translations[np.concatenate(sources)]] = True
        chosen[:, self.frequent] = True
        return chosen

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, translations=self.translations, frequent=self.frequent)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source_size: int, target_size: int) -> Shortlist:
        """Read and check a shortlist against the vocabulary sizes it must fit."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
                shortlist = cls(arrays["translations"], arrays["frequent"], target_size)
        except (OSError, ValueError, KeyError) as exc:
            raise NmtError(f"the vocabulary shortlist is not readable: {exc}") from exc
        for name, array in (("translations", shortlist.translations), ("frequent", shortlist.frequent)):
            if array.dtype.kind not in "iu" or (array.size and not 0 <= array.min() <= array.max() < target_size):
                raise NmtError(f"the vocabulary shortlist's {name} are not ids of the {target_size}-piece target "
                               "vocabulary")
        if shortlist.translations.ndim != 2 or len(shortlist.translations) != source_size:
            raise NmtError(f"the vocabulary shortlist has {len(shortlist.translations)} source pieces, the source "
                           f"vocabulary {source_size}")
        return shortlist

    def save(self, path: str | os.PathLike) -> None:
        with atomic_write(path, "wb") as handle:
            handle.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike, source_size: int, target_size: int) -> Shortlist:
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise NmtError(f"cannot read the vocabulary shortlist {path}: {exc.strerror or exc}") from exc
        return cls.from_bytes(data, source_size, target_size)


@dataclass
class Links:
    """Every (source piece or NULL, target piece) pair of the sampled sentences, one per target
    position and source position: IBM model 1's possible alignments."""

    pair: np.ndarray  # index into ``pairs`` of each link
    position: np.ndarray  # the target position (over all sampled sentences) each link aligns
    pairs: np.ndarray  # the distinct (source * target_size + target) keys, sorted
    target_tokens: np.ndarray  # the sampled sentences' target pieces, each once


def learn_shortlist(source: tuple[np.ndarray, np.ndarray], target: tuple[np.ndarray, np.ndarray],
                    source_size: int, target_size: int, joint: bool, per_piece: int = PER_PIECE,
                    frequent: int = FREQUENT, max_links: int = MAX_LINKS, iterations: int = ITERATIONS) -> Shortlist:
    """The shortlist of a binarized parallel corpus, each side given as (flat tokens, n+1 offsets) with
    every sentence ending in EOS; ``joint``: source and target ids are the same pieces."""
    links = sample_links(source, target, source_size, target_size, max_links)
    dtype = np.dtype(np.uint16) if target_size <= 1 << 16 else np.dtype(np.int32)
    counts = np.bincount(links.target_tokens, minlength=target_size)
    most = np.argsort(-counts, kind="stable")[:frequent]
    most = most[counts[most] > 0].astype(dtype)
    sources, targets = links.pairs // target_size, links.pairs % target_size
    probabilities = model1(links, sources, source_size + 1, iterations)
    rare = ~np.isin(targets, most)  # the frequent pieces are candidates anyway: the k slots go to others
    table = top_translations(sources[rare], targets[rare], probabilities[rare], source_size, per_piece, dtype)
    if joint:
        add_identity(table)
    return Shortlist(table, most, target_size)


def sample_links(source: tuple[np.ndarray, np.ndarray], target: tuple[np.ndarray, np.ndarray], source_size: int,
                 target_size: int, max_links: int) -> Links:
    """The links of all sentences, or of a seeded random sample of them holding at most ``max_links``.
    The NULL word has the source id ``source_size``."""
    (source_tokens, source_offsets), (target_tokens, target_offsets) = source, target
    source_lengths = np.diff(source_offsets) - 1  # EOS excluded
    target_lengths = np.diff(target_offsets) - 1
    per_sentence = (source_lengths + 1) * target_lengths  # NULL is a source position too
    order = np.arange(len(per_sentence))
    if per_sentence.sum() > max_links:
        order = np.random.default_rng(SAMPLE_SEED).permutation(len(per_sentence))
    chosen = np.sort(order[:np.searchsorted(np.cumsum(per_sentence[order]), max_links, side="right")])
    chosen = chosen[(source_lengths[chosen] > 0) & (target_lengths[chosen] > 0)]
    if not len(chosen):
        raise NmtError("no training pair to learn the vocabulary shortlist from")
    lengths_s, lengths_t, counts = source_lengths[chosen], target_lengths[chosen], per_sentence[chosen]
    sentence = np.repeat(np.arange(len(chosen), dtype=np.int32), counts)  # arrays of one entry per link: kept small
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    i, j = (within // lengths_t[sentence]).astype(np.int32), (within % lengths_t[sentence]).astype(np.int32)
    del within
    is_null = i == lengths_s[sentence]  # source position |source| is NULL
    i[is_null] = 0
    target_ids = np.asarray(target_tokens)[target_offsets[chosen][sentence] + j].astype(np.int64)
    target_tokens = target_ids[is_null]  # each target position has one NULL link
    keys = np.asarray(source_tokens)[source_offsets[chosen][sentence] + i].astype(np.int64)
    del i
    keys[is_null] = source_size
    keys *= target_size
    keys += target_ids
    del target_ids, is_null
    position = (np.cumsum(lengths_t) - lengths_t).astype(np.int32)[sentence] + j
    del sentence, j
    pairs, pair = np.unique(keys, return_inverse=True)
    return Links(pair.astype(np.int32), position, pairs, target_tokens)


def model1(links: Links, sources: np.ndarray, source_count: int, iterations: int) -> np.ndarray:
    """p(target | source) of each distinct pair after ``iterations`` of EM from uniform."""
    probabilities = np.ones(len(links.pairs))
    for _ in range(iterations):
        weights = probabilities[links.pair]
        weights /= np.bincount(links.position, weights=weights)[links.position]  # each target position's posterior
        counts = np.bincount(links.pair, weights=weights, minlength=len(links.pairs))
        probabilities = counts / np.bincount(sources, weights=counts, minlength=source_count)[sources]
    return probabilities


def top_translations(sources: np.ndarray, targets: np.ndarray, probabilities: np.ndarray, source_size: int,
                     per_piece: int, dtype: np.dtype) -> np.ndarray:
    """(source_size, per_piece) table of each source piece's likeliest targets, padded with 0."""
    order = np.lexsort((-probabilities, sources))  # by source, likeliest first
    sources, targets = sources[order], targets[order]
    starts = np.searchsorted(sources, sources, side="left")
    rank = np.arange(len(sources)) - starts
    keep = (rank < per_piece) & (sources < source_size)  # not the NULL word's
    table = np.zeros((source_size, per_piece), dtype=dtype)
    table[sources[keep], rank[keep]] = targets[keep]
    return table


def add_identity(table: np.ndarray) -> None:
    """Make each source piece a candidate for itself (a joint vocabulary), in its row's first free
    slot or, in a full row, in place of its least likely translation."""
    pieces = np.arange(len(table))
    missing = ~(table == pieces[:, None]).any(axis=1)
    slot = np.minimum((table != 0).sum(axis=1), table.shape[1] - 1)
    table[pieces[missing], slot[missing]] = pieces[missing]
