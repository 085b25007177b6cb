"""What a model must provide to be searched (beam search, greedy, sampling): the whole contract
between ``nmt.generation.search`` and a model. The Transformer implements it; so does the
scripted toy decoder of tests/test_search.py."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class DecoderState(Protocol):
    """The decoder's memory of the tokens fed so far, one row per hypothesis."""

    def reorder(self, indices: Tensor) -> None:
        """Row i becomes old row ``indices[i]`` (rows may be duplicated or dropped)."""


@runtime_checkable
class SearchableModel(Protocol):
    def encode(self, source: Tensor, columns: Tensor | None = None) -> Any:
        """The encoder output for a padded batch of sources (batch, length), one row per sentence.

        With ``columns`` (vocabulary ids, ascending: a shortlist's candidates), ``decode`` given this
        output returns logits for those entries only, in that order. Search passes it only when it
        has a shortlist: a model without one need not take it."""

    def reorder_encoder_out(self, encoder_out: Any, indices: Tensor) -> Any:
        """The encoder output of some sentences: row i becomes old row ``indices[i]``. Search calls it
        when sentences leave the batch; beams move within their sentence, which needs no call."""

    def new_cache(self) -> DecoderState:
        """An empty decoder state for incremental decoding."""

    def decode(self, prev_output_tokens: Tensor, encoder_out: Any, cache: DecoderState) -> Tensor:
        """Logits (rows, new, vocab) for the new tokens (rows, new), continuing ``cache`` and updating it.

        ``rows`` is k times the encoder output's sentences, k consecutive rows per sentence (its beams,
        1 at beam search's first step), so that the encoder output is never copied per beam."""
