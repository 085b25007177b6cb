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
    def encode(self, source: Tensor) -> Any:
        """The encoder output for a padded batch of sources (batch, length), one row per sentence."""

    def reorder_encoder_out(self, encoder_out: Any, indices: Tensor) -> Any:
        """Encoder rows for new decoder rows: row i becomes old row ``indices[i]``. Search calls it
        only when rows change sentence (widening to the beam, sentences leaving); the beams of one
        sentence share its row's content, so moving beams within a sentence needs no call."""

    def new_cache(self) -> DecoderState:
        """An empty decoder state for incremental decoding."""

    def decode(self, prev_output_tokens: Tensor, encoder_out: Any, cache: DecoderState) -> Tensor:
        """Logits (rows, new, vocab) for the new tokens (rows, new), continuing ``cache`` and updating it."""
