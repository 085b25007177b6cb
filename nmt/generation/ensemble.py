"""Ensembles: several models decode as one, each with its own encoder output and decoder cache.

The ensemble's next-token distribution is the mean of the models' log-probabilities,
renormalized: log q(y) = mean_m log p_m(y) - log Z, with Z = sum_y prod_m p_m(y)^(1/M) (a
normalized geometric mean, Marian's and Sockeye's log-linear ensembling). Z <= 1 (the geometric
mean is at most the arithmetic one), so every token's log q is at least the models' mean log p.
``decode`` returns these log-probabilities; beam search applies ``log_softmax`` to what decode
returns, which leaves normalized log-probabilities unchanged (their logsumexp is 0).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt.backends.torch_backend import TorchBackend


class EnsembleCache:
    """One decoder cache per model; beam search reorders them all alike."""

    def __init__(self, caches: list):
        self.caches = caches

    def reserve(self, positions: int, rows: int) -> None:
        for cache in self.caches:
            cache.reserve(positions, rows)

    def reorder(self, indices: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(indices)


class Ensemble(nn.Module):
    """The interface beam search uses (encode, decode, new_cache, reorder_encoder_out) over several models."""

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        self.models = nn.ModuleList(models)

    @property
    def backend(self) -> TorchBackend:
        """The models' (prepare_model gives them all the same)."""
        return self.models[0].backend

    def encode(self, source: Tensor, columns: Tensor | None = None) -> list:
        return [model.encode(source, columns) for model in self.models]

    def reorder_encoder_out(self, encoder_outs: list, indices: Tensor) -> list:
        return [model.reorder_encoder_out(out, indices) for model, out in zip(self.models, encoder_outs)]

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([model.new_cache() for model in self.models])

    def decode(self, prev_output_tokens: Tensor, encoder_outs: list, cache: EnsembleCache | None = None) -> Tensor:
        """Log-probabilities (not logits) for each given position: the renormalized mean of the models'."""
        caches = cache.caches if cache is not None else [None] * len(self.models)
        logprobs = [model.decode(prev_output_tokens, out, model_cache).float().log_softmax(dim=-1)
                    for model, out, model_cache in zip(self.models, encoder_outs, caches)]
        return torch.stack(logprobs).mean(dim=0).log_softmax(dim=-1)
