"""A batch's output columns under a vocabulary shortlist (nmt/data/shortlist.py).

The model projects onto the union of the batch's candidates only (``columns``: full-vocabulary
ids, sorted, the special tokens first, so that a special token's column is its id); search then
works in that column space (see nmt/generation/search.py). Each sentence keeps to its own
candidates, whatever else its batch holds (``others`` bans the rest): its translation does not
depend on its neighbours, as without a shortlist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch import Tensor

from nmt.data.shortlist import Shortlist
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SPECIALS = np.asarray(sorted((PAD_ID, UNK_ID, BOS_ID, EOS_ID)))
assert (SPECIALS == np.arange(len(SPECIALS))).all(), "search relies on a special token's column being its id"


@dataclass
class Candidates:
    columns: Tensor  # (columns,) the batch's candidates as full-vocabulary ids, ascending
    others: Tensor | None  # (sentences, columns): -inf at other sentences' candidates, else 0; None: all 0

    def restrict(self, logits: Tensor, sentences: Tensor) -> Tensor:
        """Ban, in place, each row's columns outside its sentence's candidates; ``logits`` has one
        row per hypothesis, the same number for each of the batch's ``sentences`` (original indices).
        (Adding -inf: 5x faster than a masked fill that broadcasts over the beams.)"""
        if self.others is not None:
            logits.view(len(sentences), -1, logits.size(-1)).add_(self.others[sentences].unsqueeze(1))
        return logits


def batch_candidates(shortlist: Shortlist, sources: list[np.ndarray], device: torch.device,
                     required: list[Iterable[int]] | None = None) -> Candidates:
    """The candidates of a batch of sources (token ids), with the special tokens and, per sentence,
    the ``required`` target ids (a target prefix or constraint pieces: they must be reachable)."""
    required = required or [()] * len(sources)
    own = [np.union1d(shortlist.candidates(source), np.fromiter(needed, dtype=np.int64))
           for source, needed in zip(sources, required)]
    columns = np.unique(np.concatenate([SPECIALS, *own]))
    others = np.full((len(sources), len(columns)), -np.inf, dtype=np.float32)
    others[:, :len(SPECIALS)] = 0.0
    for row, ids in enumerate(own):
        others[row, np.searchsorted(columns, ids)] = 0.0
    return Candidates(torch.from_numpy(columns).to(device),
                      None if not np.isinf(others).any() else torch.from_numpy(others).to(device))
