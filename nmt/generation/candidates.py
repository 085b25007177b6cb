"""Each sentence's output columns under a vocabulary shortlist (nmt/data/shortlist.py).

A sentence scores only its own candidates: the search's log-probabilities have one row per
hypothesis and one column per candidate of the hypothesis's sentence (``columns``: full-vocabulary
ids, ascending, the special tokens first, so that a special token's column is its id). A batch's
sentences hold different numbers of candidates; the shorter lists repeat their last id, and those
columns are banned (``padding``). A sentence's translation does not depend on its neighbours, as
without a shortlist, and each step's log-softmax and top-k cover the batch's longest list (a few
hundred) rather than the union of its sentences' (thousands: docs/performance.md). The projection
onto the columns is the model's (nmt.models.transformer.Transformer.column_projection).
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
    columns: Tensor  # (sentences, width) long: each sentence's candidates, ascending; a shorter list repeats its last
    padding: Tensor | None  # (sentences, width): -inf at the repeats, else 0; None: no sentence has any


def batch_candidates(shortlist: Shortlist, sources: list[np.ndarray], device: torch.device,
                     required: list[Iterable[int]] | None = None) -> Candidates:
    """The candidates of a batch of sources (token ids), with the special tokens and, per sentence,
    the ``required`` target ids (a target prefix or constraint pieces: they must be reachable)."""
    chosen = shortlist.candidates(sources)
    chosen[:, SPECIALS] = True
    for row, needed in enumerate(required or ()):
        chosen[row, list(needed)] = True
    counts = chosen.sum(axis=1)
    width = int(counts.max())
    rows, ids = chosen.nonzero()  # row by row, ascending ids within a row
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slots = np.arange(len(ids)) - starts[rows]
    columns = np.repeat(ids[starts + counts - 1][:, None], width, axis=1)  # each row's last id everywhere
    columns[rows, slots] = ids
    padding = None if (counts == width).all() else torch.from_numpy(
        np.where(np.arange(width) < counts[:, None], 0.0, -np.inf).astype(np.float32)).to(device)
    return Candidates(torch.from_numpy(columns.astype(np.int64)).to(device), padding)
