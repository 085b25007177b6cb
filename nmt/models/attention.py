"""Multi-head attention: the projections into heads and back; the attention itself is the backend's
(nmt/backends/torch_backend.py: ``scaled_dot_product_attention`` unless decoding chose another)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from nmt.backends.torch_backend import TORCH, TorchBackend


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.heads = heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, heads, T, D/heads)."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, -1).transpose(1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, heads, T, D/heads) -> (B, T, D), through the output projection."""
        batch, _, length, _ = x.shape
        return self.out_proj(x.transpose(1, 2).reshape(batch, length, -1))

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(memory)), self.split_heads(self.v_proj(memory))

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's queries, keys and values (B, heads, T, D/heads)."""
        return (self.split_heads(self.q_proj(x)), *self.project_kv(x))

    def forward(self, query: Tensor, keys_values: Any, mask: Tensor | None = None, is_causal: bool = False,
                backend: TorchBackend = TORCH) -> Tensor:
        """query (B, T, D); ``keys_values``: the keys and values, already projected and split ((B, H, S,
        D/H) each), as the backend keeps them: a pair (in decoding's cross-attention, what the backend's
        select_sentences made of one).

        ``mask`` is boolean, broadcastable to (B, H, T, S), True where attention is allowed."""
        q = self.split_heads(self.q_proj(query))
        dropout = self.dropout if self.training else 0.0
        return self.merge_heads(backend.attention(q, keys_values, mask, is_causal, dropout))

    def attend_cached(self, x: Tensor, cache: Any, backend: TorchBackend) -> Tensor:
        """Self-attention of new positions ``x`` (B, new, D) over those in ``cache`` (one layer's of
        ``backend.new_cache``) and their own, causally; their keys and values join the cache."""
        return self.merge_heads(backend.cached_attention(*self.project_qkv(x), cache))
