"""Length-bucketed batches of about ``max_tokens`` tokens, and padding them into tensors.

Token conventions shared by train and generate: every stored sentence ends in EOS; the decoder
reads ``[BOS] + target[:-1]`` and predicts ``target``; padding (PAD_ID) is on the right.
"""

from __future__ import annotations

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
                  max_sentences: int | None = None, required_multiple: int = 1) -> list[np.ndarray]:
    """Group sentence indices into batches of similar length.

    Sentences are sorted by (target, source) length; a batch grows while
    ``len(batch) * longest_in_batch`` (padding included) stays within ``max_tokens`` on both
    sides and ``len(batch)`` within ``max_sentences``. Batch sizes are rounded down to a
    multiple of ``required_multiple`` where that leaves a non-empty batch.
    """
    if max_tokens is None and max_sentences is None:
        raise NmtError("give --max-tokens or --max-sentences")
    for unit, budget in (("tokens", max_tokens), ("sentences", max_sentences)):
        if budget is not None and budget < 1:  # no batch could take a sentence: the loop below would never end
            raise NmtError(f"a batch limit of {budget} {unit} cannot hold any sentence; it must be at least 1")
    sizes = np.maximum(source_sizes, target_sizes) if target_sizes is not None else np.asarray(source_sizes)
    if max_tokens is not None and len(sizes) and sizes.max() > max_tokens:
        longest = int(np.argmax(sizes))
        raise SentenceTooLong(f"sentence {longest} has {int(sizes[longest])} tokens, more than --max-tokens {max_tokens}; "
                       "raise --max-tokens or filter long sentences in preprocess (--max-len)")
    order = np.lexsort((source_sizes, sizes)) if target_sizes is not None else np.argsort(sizes, kind="stable")
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        end = start
        longest = 0
        while end < len(order):
            candidate = max(longest, int(sizes[order[end]]))
            count = end - start + 1
            if (max_tokens is not None and candidate * count > max_tokens) or \
                    (max_sentences is not None and count > max_sentences):
                break
            longest = candidate
            end += 1
        count = end - start
        if required_multiple > 1 and count > required_multiple:
            count -= count % required_multiple
        batches.append(order[start:start + count])
        start += count
    return batches
