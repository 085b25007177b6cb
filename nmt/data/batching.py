"""Length-bucketed batches of about ``max_tokens`` tokens, and padding them into tensors.

Token conventions shared by train and generate: every stored sentence ends in EOS; the decoder
reads ``[BOS] + target[:-1]`` and predicts ``target``; padding (PAD_ID) is on the right.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nmt.data.vocabulary import BOS_ID, PAD_ID
from nmt.errors import NmtError


@dataclass
class Batch:
    indices: Tensor  # (B,) positions of the sentences in their split
    source: Tensor  # (B, S)
    prev_output: Tensor | None = None  # (B, T) decoder input: BOS + target without its last token
    target: Tensor | None = None  # (B, T)

    def __len__(self) -> int:
        return self.source.size(0)

    def to(self, device: torch.device | str) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(self.indices, move(self.source), move(self.prev_output), move(self.target))


class SentenceTooLong(NmtError):
    """A sentence longer than the token budget of a batch (training may skip such sentences instead)."""


def pad_sequences(sequences: list[np.ndarray], pad_id: int = PAD_ID) -> Tensor:
    length = max(len(s) for s in sequences)
    out = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    return out


def collate(indices: list[int] | np.ndarray, sources: list[np.ndarray],
            targets: list[np.ndarray] | None = None) -> Batch:
    batch = Batch(torch.as_tensor(np.asarray(indices), dtype=torch.long), pad_sequences(sources))
    if targets is not None:
        batch.target = pad_sequences(targets)
        batch.prev_output = pad_sequences([np.concatenate(([BOS_ID], t[:-1])) for t in targets])
    return batch


def batch_by_size(source_sizes: np.ndarray, target_sizes: np.ndarray | None, max_tokens: int | None,
                  max_sentences: int | None = None, required_multiple: int = 1,
                  rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Group sentence indices into batches of similar length.

    Sentences are sorted by length (``length_order``); a batch grows while
    ``len(batch) * longest_in_batch`` (padding included) stays within ``max_tokens`` on both
    sides and ``len(batch)`` within ``max_sentences`` (``batch_sizes``).
    """
    sizes = padded_sizes(source_sizes, target_sizes, max_tokens, max_sentences)
    order = length_order(length_keys(source_sizes, target_sizes), rng)
    ends = np.cumsum(batch_sizes(sizes[order], max_tokens, max_sentences, required_multiple))
    return np.split(order, ends[:-1]) if len(ends) else []


def padded_sizes(source_sizes: np.ndarray, target_sizes: np.ndarray | None, max_tokens: int | None,
                 max_sentences: int | None) -> np.ndarray:
    """Each sentence's (pair's) size in a batch, the longer side; an error if the budget cannot hold one."""
    if max_tokens is None and max_sentences is None:
        raise NmtError("give --max-tokens or --max-sentences")
    for unit, budget in (("tokens", max_tokens), ("sentences", max_sentences)):
        if budget is not None and budget < 1:  # no batch could take a sentence: the loop below would never end
            raise NmtError(f"a batch limit of {budget} {unit} cannot hold any sentence; it must be at least 1")
    sizes = np.maximum(source_sizes, target_sizes) if target_sizes is not None else np.asarray(source_sizes)
    if max_tokens is not None and len(sizes) and sizes.max() > max_tokens:
        longest = int(np.argmax(sizes))
        raise SentenceTooLong(f"sentence {longest} has {int(sizes[longest])} tokens, more than --max-tokens "
                              f"{max_tokens}; raise --max-tokens or filter long sentences in preprocess (--max-len)")
    return sizes


def length_keys(source_sizes: np.ndarray, target_sizes: np.ndarray | None) -> np.ndarray:
    """Each sentence's sort key, (longer side, source) length as one number.

    In the smallest unsigned dtype that holds it: 16 bits whenever the lengths stay under 255
    (preprocess's --max-len 250), where sorting by it is a radix sort (linear time).
    """
    source_sizes = np.asarray(source_sizes)
    sizes = np.maximum(source_sizes, target_sizes) if target_sizes is not None else source_sizes
    keys = sizes.astype(np.int64) * (int(source_sizes.max(initial=0)) + 1) + source_sizes
    return keys.astype(smallest_unsigned(int(keys.max(initial=0))))


def smallest_unsigned(largest: int) -> type:
    return next(dtype for dtype in (np.uint16, np.uint32, np.uint64) if largest <= np.iinfo(dtype).max)


def length_order(keys: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """Sentence indices sorted by their length keys (``length_keys``).

    Equal lengths stay in index order, or in a random order drawn from ``rng`` (permuted before
    the stable sort, as fairseq does), so that batches mix the parts of a concatenated corpus.
    """
    shuffled = np.arange(len(keys), dtype=np.int64 if len(keys) > np.iinfo(np.int32).max else np.int32)
    if rng is not None:
        rng.shuffle(shuffled)
    return shuffled[np.argsort(keys[shuffled], kind="stable")]


def batch_sizes(sorted_sizes: np.ndarray, max_tokens: int | None, max_sentences: int | None = None,
                required_multiple: int = 1) -> np.ndarray:
    """How many sentences each batch takes, from sentences in ascending size order.

    They depend on the sorted sizes alone, not on which of several equal-length sentences comes
    first. Counts are rounded down to a multiple of ``required_multiple`` where that leaves a
    non-empty batch.
    """
    counts = []
    start = 0
    while start < len(sorted_sizes):
        count = len(sorted_sizes) - start if max_sentences is None else min(max_sentences, len(sorted_sizes) - start)
        if max_tokens is not None:
            count = min(count, max_tokens // int(sorted_sizes[start]))  # all as short as the first: the most
            if int(sorted_sizes[start + count - 1]) * count > max_tokens:  # longer ones among them: bisect,
                count = bisect.bisect_right(range(1, count + 1), max_tokens,  # as the padded size grows with count
                                            key=lambda n: int(sorted_sizes[start + n - 1]) * n)
        if required_multiple > 1 and count > required_multiple:
            count -= count % required_multiple
        counts.append(count)
        start += count
    return np.array(counts, dtype=np.int64)
