"""Multi-head attention on top of ``scaled_dot_product_attention``, with a key/value cache."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import nmt.models.cpu_kernels as cpu_kernels

# cuDNN's attention kernel builds an execution plan per input shape. Length-bucketed batches and
# step-by-step decoding make nearly every call a new shape: with it, bf16 training ran 4x and bf16
# beam search 15x slower than without it on an H100 (docs/performance.md). The others have no such cost.
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
        # Inference in int8 only: q_proj, k_proj and v_proj as one product (nmt.models.int8.fuse_layers).
        self.qkv_proj: nn.Module | None = None

    def split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, -1).transpose(1, 2)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(memory)), self.split_heads(self.v_proj(memory))

    def project_q(self, x: Tensor) -> Tensor:
        """Queries (B, T, H, D/H), as the C kernels read them."""
        return self.q_proj(x).unflatten(-1, (self.heads, -1))

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's queries (B, T, H, D/H) and keys and values (B, H, T, D/H), in one
        product where the three are fused."""
        if self.qkv_proj is None:
            return (self.project_q(x), *self.project_kv(x))
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return q.unflatten(-1, (self.heads, -1)), self.split_heads(k), self.split_heads(v)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                is_causal: bool = False, rows: Tensor | None = None) -> Tensor:
        """query (B, T, D); key/value already projected and split: (B, H, S, D/H).

        ``mask`` is boolean, broadcastable to (B, H, T, S), True where attention is allowed. A mask
        of (B, 1, 1, S) (the source's padding) at inference on CPU: nmt's C kernel, where each
        sentence's queries attend to its keys together (nmt/models/cpu_kernels.py). ``rows``: query
        i's row of ``key``, ``value`` and ``mask`` (beam search leaves them in place as sentences
        leave; None: row i).
        """
        sentences = key.size(0) if rows is None else rows.numel()
        if mask is not None and mask.dtype == torch.bool and query.size(0) == sentences and \
                mask.shape == (key.size(0), 1, 1, key.size(2)) and cpu_kernels.usable(query):
            return self.attend_with(query, lambda q: cpu_kernels.grouped_attention(
                key, value, mask.reshape(key.size(0), -1), q, rows))
        key, value, mask = select_rows(rows, key, value, mask)
        q = self.split_heads(self.q_proj(query))
        dropout = self.dropout if self.training else 0.0
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            out = cpu_attention_in_fp32(q, key, value, mask, is_causal, dropout)
        else:
            with sdpa_kernel(CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, is_causal=is_causal,
                                                     dropout_p=dropout)
        batch, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def attend_with(self, query: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        """Like ``forward``, with the attention computed by ``attend`` from the projected queries
        (B, T, H, D/H), which knows its keys and values: decoding's C kernels (nmt/models/cpu_kernels.py)."""
        return self.attend_projected(self.project_q(query), attend)

    def attend_projected(self, q: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        """``attend_with`` for queries already projected (B, T, H, D/H)."""
        batch, length, heads, head_dim = q.shape
        return self.out_proj(attend(q).reshape(batch, length, heads * head_dim))


def select_rows(rows: Tensor | None, key: Tensor, value: Tensor, mask: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``key``, ``value`` and ``mask`` at ``rows`` (see MultiHeadAttention.forward), as they are without."""
    if rows is None:
        return key, value, mask
    return key.index_select(0, rows), value.index_select(0, rows), None if mask is None else mask.index_select(0, rows)


def causal_mask(new: int, past: int, device: torch.device) -> Tensor:
    """Allowed-attention mask for ``new`` queries that follow ``past`` cached positions."""
    rows = torch.arange(new, device=device)[:, None] + past
    cols = torch.arange(past + new, device=device)[None, :]
    return cols <= rows


def cpu_attention_in_fp32(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
                          dropout: float) -> Tensor:
    """Attention on CPU under bf16, computed in fp32; the projections around it stay bf16.

    torch's CPU attention kernel is much slower in bf16 than in fp32 on CPUs with avx512_bf16:
    5x in training's backward pass and 2x for decoding's one-query steps (docs/performance.md),
    far more than the casts of queries, keys and values cost. The decoder cache and the encoder's
    keys/values for decoding are kept in fp32 on CPU, so that decoding casts only the query.
    """
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                             is_causal=is_causal, dropout_p=dropout)
    return out.to(query.dtype)
