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


def batch_candidates(shortlist: Shortlist, sources: list[np.ndarray], device: torch.device,
                     required: list[Iterable[int]] | None = None) -> Candidates:
    """The candidates of a batch of sources (token ids), with the special tokens and, per sentence,
    the ``required`` target ids (a target prefix or constraint pieces: they must be reachable)."""
    chosen = shortlist.candidates(sources)
    chosen[:, SPECIALS] = True
    for row, needed in enumerate(required or ()):
        chosen[row, list(needed)] = True
    columns = chosen.any(axis=0).nonzero()[0]
    own = chosen[:, columns]
    others = None if own.all() else torch.from_numpy(  # row-major: each step reads its sentences' rows
        np.ascontiguousarray(np.where(own, 0.0, -np.inf), dtype=np.float32)).to(device)
    return Candidates(torch.from_numpy(columns).to(device), others)
