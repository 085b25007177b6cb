"""The decoder's self-attention keys and values during incremental decoding.

Each step appends one position per row and beam search then reorders the rows (beams move,
finished sentences leave). Growing a tensor with ``torch.cat`` and reordering it with a fresh
``index_select`` copied the whole history twice per step and allocated twice. Here the history
lives in a preallocated time-major buffer, ``(capacity, rows, heads, head_dim)``: a step writes
its position in place, the first ``length`` positions are one contiguous block, and a reorder is
a single ``index_select`` of that block into a spare buffer of the same shape (then the two swap).
It is for inference (``torch.no_grad``/``inference_mode``): reordering writes into existing storage.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KeyValueCache:
    """One attention layer's keys and values so far, for ``rows`` hypotheses."""

    def __init__(self) -> None:
        self.length = 0
        self.buffers: tuple[Tensor, Tensor] | None = None  # keys, values: (capacity, rows, heads, head_dim)
        self.spares: tuple[Tensor, Tensor] | None = None  # where the next reorder writes

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Add new positions, given as (rows, heads, new, head_dim); returns all keys and values
        so far in that layout (views of the buffers, no copy)."""
        new = keys.size(2)
        if self.buffers is None or self.length + new > self.buffers[0].size(0):
            self._grow(keys, self.length + new)
        for buffer, tensor in zip(self.buffers, (keys, values)):
            buffer[self.length:self.length + new] = tensor.permute(2, 0, 1, 3)
        self.length += new
        return tuple(buffer[:self.length].permute(1, 2, 0, 3) for buffer in self.buffers)

    def _grow(self, like: Tensor, needed: int) -> None:
        """Room for at least ``needed`` positions, doubling so that growth costs O(1) per step."""
        capacity = max(needed, 2 * self.buffers[0].size(0) if self.buffers else 16)
        rows, heads, _, head_dim = like.shape
        fresh = tuple(like.new_empty(capacity, rows, heads, head_dim, dtype=self.dtype(like)) for _ in range(2))
        if self.buffers is not None:
            for old, new in zip(self.buffers, fresh):
                new[:self.length] = old[:self.length]
        self.buffers = fresh
        self.spares = tuple(like.new_empty(capacity, rows, heads, head_dim, dtype=self.dtype(like)) for _ in range(2))

    @staticmethod
    def dtype(like: Tensor) -> torch.dtype:
        """fp32 on CPU whatever the projections compute in: one-query attention runs in fp32 there
        (nmt.models.attention.cpu_attention_in_fp32), so bf16 keys are widened once, when written."""
        return torch.float32 if like.device.type == "cpu" else like.dtype

    def reorder(self, indices: Tensor) -> None:
        """Row i becomes old row ``indices[i]``: the surviving beams' origins."""
        if self.buffers is None:
            return
        if self.spares[0].size(1) != len(indices):  # sentences left (or did last time): fewer rows
            self.spares = tuple(buffer.new_empty(buffer.size(0), len(indices), *buffer.shape[2:])
                                for buffer in self.buffers)
        for buffer, spare in zip(self.buffers, self.spares):
            torch.index_select(buffer[:self.length], 1, indices, out=spare[:self.length])
        self.buffers, self.spares = self.spares, self.buffers


class DecoderCache:
    """Every decoder layer's :class:`KeyValueCache`. The encoder-decoder keys and values are not
    here: they are computed once per sentence by ``encode`` and travel with its output."""

    def __init__(self, num_layers: int):
        self.layers = [KeyValueCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reorder(self, indices: Tensor) -> None:
        """Keep/duplicate rows: beam search calls this with the surviving beams' origins."""
        for layer in self.layers:
            layer.reorder(indices)
