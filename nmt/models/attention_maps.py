"""Attention probabilities, computed explicitly only when someone asks for them.

The model attends through ``scaled_dot_product_attention``, which never returns its weights.
Rather than give every layer a "also return weights" flag (and a slower path to maintain),
:func:`attention_maps` runs one teacher-forced forward pass with hooks on the attention modules:
each hook recomputes softmax(QK^T / sqrt(d_k)) from the same query, keys and mask, and records
it. Search and training never see the hooks, so the fast path stays exactly as it is.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn

from nmt.errors import NmtError
from nmt.models.attention import MultiHeadAttention


@dataclass
class AttentionMaps:
    """Per layer, (batch, heads, queries, keys) probabilities; rows sum to 1 over allowed keys."""

    encoder: list[Tensor] = field(default_factory=list)  # encoder self-attention: (B, H, S, S)
    decoder: list[Tensor] = field(default_factory=list)  # decoder self-attention: (B, H, T, T)
    cross: list[Tensor] = field(default_factory=list)  # encoder-decoder attention: (B, H, T, S)


def attention_probabilities(q: Tensor, k: Tensor, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) with SDPA's mask conventions (boolean, True = may attend)."""
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.size(-1))
    if is_causal:
        queries, keys = scores.shape[-2:]  # SDPA's causal mask is aligned top-left
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def explicit_attention(module: MultiHeadAttention, query: Tensor, keys_values: tuple[Tensor, Tensor],
                       mask: Tensor | None = None, is_causal: bool = False,
                       backend: object = None) -> tuple[Tensor, Tensor]:
    """What ``module(query, keys_values, mask, is_causal, backend)`` computes (in eval mode), and its
    weights; every backend computes the same attention, so ``backend`` changes nothing here (the keys and
    values are a pair: attention maps come from a teacher-forced pass, whose encoder output is never reordered)."""
    key, value = keys_values
    weights = attention_probabilities(module.split_heads(module.q_proj(query)), key, mask, is_causal)
    out = weights.to(value.dtype) @ value
    batch, _, length, _ = out.shape
    return module.out_proj(out.transpose(1, 2).reshape(batch, length, -1)), weights


def layer_index(layer: int | None, count: int, option: str) -> int:
    """0-based index of the 1-based ``layer`` of ``count`` (unset: the penultimate, as fairseq aligns and
    the paper's figures show); ``option`` names it in the error."""
    chosen = layer if layer is not None else max(count - 1, 1)
    if not 1 <= chosen <= count:
        raise NmtError(f"{option} must be between 1 and {count} for this model, got {chosen}")
    return chosen - 1


def _recorder(into: list[Tensor]):
    def hook(module: MultiHeadAttention, args: tuple, kwargs: dict, output: Tensor) -> None:
        query, (key, _) = (list(args) + [kwargs.get(name) for name in ("query", "keys_values")])[:2]
        weights = attention_probabilities(module.split_heads(module.q_proj(query)), key, kwargs.get("mask"),
                                          kwargs.get("is_causal", False))
        into.append(weights.detach())

    return hook


@contextlib.contextmanager
def recorded_attention(model: nn.Module) -> Iterator[AttentionMaps]:
    """Record the attention of every layer during the forward passes run inside the block."""
    maps = AttentionMaps()
    modules = [(layer.self_attn, maps.encoder) for layer in model.encoder_layers]
    modules += [(layer.self_attn, maps.decoder) for layer in model.decoder_layers]
    modules += [(layer.cross_attn, maps.cross) for layer in model.decoder_layers]
    handles = [module.register_forward_hook(_recorder(into), with_kwargs=True) for module, into in modules]
    try:
        yield maps
    finally:
        for handle in handles:
            handle.remove()


def attention_maps(model: nn.Module, src_tokens: Tensor, prev_output_tokens: Tensor) -> AttentionMaps:
    """One teacher-forced pass (no dropout, no gradients) that returns every layer's attention."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), recorded_attention(model) as maps:
            model(src_tokens, prev_output_tokens)
    finally:
        model.train(was_training)
    return maps
