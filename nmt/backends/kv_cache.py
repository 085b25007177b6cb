"""The decoder's self-attention keys and values during incremental decoding.

Each step appends one position per row and beam search then reorders the rows (beams move,
finished sentences leave). A layer's history lives in one flat buffer viewed time-major as
``(capacity, rows, 2, heads, head_dim)`` (keys and values side by side): a step writes its
position in place, the first ``length`` positions are one contiguous block, and a reorder is a
single ``index_select`` of that block into a spare buffer (then the two swap). The cache keeps one
spare for all its layers: a layer's reorder hands its old buffer on as the next layer's spare, so
the history is held ``layers + 1`` times, not twice. Since the buffers are flat, fewer rows (when
sentences leave) fit in the same memory as more positions. On CPU, search reserves room for its
longest output up front: pages never written cost no memory there, while buffers replaced as they
grow scatter freed blocks that the C allocator keeps (8-140 MiB of peak RSS on 1,000 sentences,
docs/performance.md). Elsewhere, or without a reservation, a full buffer is replaced by one half
as large again. It is for inference (``torch.no_grad``/``inference_mode``): reordering writes
into existing storage. This is the torch backend's cache (nmt/backends/torch_backend.py); nmt's C
kernels keep one that moves nothing at a reorder (nmt/backends/indexed_cache.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

GROWTH = 1.5  # a full buffer is replaced by one this many times the room needed


class KeyValueCache:
    """One attention layer's keys and values so far, for ``rows`` hypotheses."""

    def __init__(self) -> None:
        self.length = 0
        self.rows = 0
        self.buffer: Tensor | None = None  # flat; see view()
        self.head_shape: tuple[int, int] = (0, 0)  # heads, head_dim
        self.reserved = 0  # positions x rows that a CPU buffer has room for from the start

    def view(self, buffer: Tensor, rows: int) -> Tensor:
        """A flat buffer as (capacity, rows, 2, heads, head_dim), the capacity it has room for."""
        per_position = rows * 2 * self.head_shape[0] * self.head_shape[1]
        capacity = buffer.numel() // per_position
        return buffer[:capacity * per_position].view(capacity, rows, 2, *self.head_shape)

    def has_room(self, buffer: Tensor | None, positions: int, rows: int) -> bool:
        return buffer is not None and buffer.numel() >= positions * rows * 2 * self.head_shape[0] * self.head_shape[1]

    def new_buffer(self, like: Tensor, positions: int, rows: int) -> Tensor:
        room = int(GROWTH * positions) * rows
        if like.device.type == "cpu":
            room = max(room, self.reserved)
        size = room * 2 * self.head_shape[0] * self.head_shape[1]
        return like.new_empty(size, dtype=self.dtype(like))

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Add new positions, given as (rows, heads, new, head_dim); returns all keys and values
        so far in that layout (views of the buffer, no copy)."""
        rows, heads, new, head_dim = keys.shape
        self.head_shape = (heads, head_dim)
        if not self.has_room(self.buffer, self.length + new, rows):
            grown = self.new_buffer(keys, self.length + new, rows)
            if self.buffer is not None:
                self.view(grown, rows)[:self.length] = self.view(self.buffer, rows)[:self.length]
            self.buffer = grown
        self.rows = rows
        block = self.view(self.buffer, rows)
        for i, tensor in enumerate((keys, values)):
            block[self.length:self.length + new, :, i] = tensor.permute(2, 0, 1, 3)
        self.length += new
        both = block[:self.length].permute(2, 1, 3, 0, 4)  # (2, rows, heads, length, head_dim)
        return both[0], both[1]

    @staticmethod
    def dtype(like: Tensor) -> torch.dtype:
        """fp32 on CPU whatever the projections compute in: one-query attention runs in fp32 there
        (nmt.backends.torch_backend.cpu_attention_in_fp32), so bf16 keys are widened once, when written."""
        return torch.float32 if like.device.type == "cpu" else like.dtype

    def reorder(self, indices: Tensor, spare: Tensor | None) -> Tensor | None:
        """Row i becomes old row ``indices[i]`` (the surviving beams' origins), written into ``spare``
        (replaced when too small, with room for the next position); returns the buffer given up, the
        next spare."""
        if self.buffer is None:
            return spare
        rows = len(indices)
        if not self.has_room(spare, self.length + 1, rows):
            spare = self.new_buffer(self.buffer, self.length + 1, rows)
        torch.index_select(self.view(self.buffer, self.rows)[:self.length], 1, indices,
                           out=self.view(spare, rows)[:self.length])
        self.buffer, spare = spare, self.buffer
        self.rows = rows
        return spare


class DecoderCache:
    """Every decoder layer's :class:`KeyValueCache`, and their one spare buffer. The encoder-decoder
    keys and values are not here: they are computed once per sentence by ``encode`` and travel with
    its output."""

    def __init__(self, num_layers: int):
        self.layers = [KeyValueCache() for _ in range(num_layers)]
        self.spare: Tensor | None = None

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reserve(self, positions: int, rows: int) -> None:
        """Room for ``positions`` positions of ``rows`` rows in every buffer made from now on (CPU only)."""
        for layer in self.layers:
            layer.reserved = positions * rows

    def reorder(self, indices: Tensor) -> None:
        """Keep/duplicate rows: beam search calls this with the surviving beams' origins."""
        for layer in self.layers:
            self.spare = layer.reorder(indices, self.spare)

    @staticmethod
    def row_bytes(layers: int, width: int, positions: int, itemsize: int, reserved: bool) -> int:
        """The most one row of ``positions`` positions (keys and values of ``width`` each) takes, in every
        layer's buffer and the spare: written as far as the row reaches where search reserved the room
        (CPU: pages never written take no memory), else in buffers grown by GROWTH, one layer holding
        its old buffer while it grows. A row that leaves gives its share to more positions of the others."""
        position = 2 * width * itemsize
        return (layers + 1) * positions * position if reserved else int((layers + 2) * GROWTH * positions) * position
