"""What a model must provide to be searched (beam search, greedy, sampling): the whole contract
between ``nmt.generation.search`` and a model. The Transformer implements it; so does the
scripted toy decoder of tests/test_search.py (with PyTorch's backend, nmt/backends/torch_backend.py).
SearchControls is the same for what changes the search of some sentences (prefixes, constraints, bans)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from nmt.backends.torch_backend import TorchBackend


@runtime_checkable
class DecoderState(Protocol):
    """The decoder's memory of the tokens fed so far, one row per hypothesis."""

    def reserve(self, positions: int, rows: int) -> None:
        """Called once before the first step with the most positions (BOS and the longest output's
        tokens) and rows (sentences x beam) it will hold (a state may make room for them at once)."""

    def reorder(self, indices: Tensor) -> None:
        """Row i becomes old row ``indices[i]`` (rows may be duplicated or dropped)."""


@runtime_checkable
class SearchableModel(Protocol):
    backend: TorchBackend  # what computes the search's log-softmax and top-k (and the model's decoding)

    def encode(self, source: Tensor, columns: Tensor | None = None) -> Any:
        """The encoder output for a padded batch of sources (batch, length), one row per sentence.

        With ``columns`` (sentences, width: each sentence's vocabulary ids, ascending: a shortlist's
        candidates), ``decode`` given this output returns logits for its sentence's entries only, in
        that order, for each row. Search passes it only when it has a shortlist: a model without one
        need not take it."""

    def reorder_encoder_out(self, encoder_out: Any, indices: Tensor) -> Any:
        """The encoder output of some sentences: row i becomes old row ``indices[i]``. Search calls it
        when sentences leave the batch; beams move within their sentence, which needs no call."""

    def new_cache(self) -> DecoderState:
        """An empty decoder state for incremental decoding."""

    def decode(self, prev_output_tokens: Tensor, encoder_out: Any, cache: DecoderState) -> Tensor:
        """Logits (rows, new, vocab) for the new tokens (rows, new), continuing ``cache`` and updating it:
        a tensor of its own, which search turns into log-probabilities in place.

        ``rows`` is k times the encoder output's sentences, k consecutive rows per sentence (its beams,
        1 at beam search's first step), so that the encoder output is never copied per beam."""


class SearchControls(Protocol):
    """What changes the search for some sentences (prefixes, constraints, bans: nmt/generation/constraints.py's
    BatchControls): the whole contract between them and ``beam_search``, which calls them only when given."""

    has_constraints: bool  # whether ``select`` revises select_top's candidates

    def begin(self, limit: Tensor, columns: Tensor | None = None) -> None:
        """The sentences' max output lengths, before the first step, and the vocabulary id of each of
        a sentence's log-probability columns (a shortlist's: sentences, width; None: column c is token c)."""

    def restrict(self, logprobs: Tensor, tokens: Tensor, step: int) -> None:
        """Ban in place what the controls forbid at this step (``tokens``: the hypotheses so far, BOS first)."""

    def select(self, top: tuple[Tensor, Tensor, Tensor], scores: Tensor, logprobs: Tensor, beam: int
               ) -> tuple[Tensor, Tensor, Tensor]:
        """The 2*beam candidates (score, beam, token) per sentence, from ``top`` (the backend's select_top)."""

    def keep(self, still: Tensor) -> None:
        """Only the sentences ``still`` stay in the batch (their columns too, with a shortlist)."""

    def reorder(self, rows: Tensor, tokens: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` with ``tokens[i]`` (a vocabulary id) appended."""
