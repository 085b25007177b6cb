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
into existing storage.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch
from torch import Tensor

from nmt.models.cpu_kernels import append_position, self_attention

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
        (nmt.models.attention.cpu_attention_in_fp32), so bf16 keys are widened once, when written."""
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


class BufferPool:
    """Flat float32 buffers that the caches of one batch hand on to the next batch's.

    A fresh buffer's pages are faulted in, and zeroed by the kernel, as positions are first written:
    about a tenth of a CPU decoding's time (docs/performance.md). A reused buffer's pages are there
    already. A cache takes a buffer for itself (threads decoding at once never share one) and gives
    it back when it is collected; the pool keeps the largest ``keep`` buffers given back.
    """

    def __init__(self, keep: int = 16):
        self.keep = keep
        self.free: list[Tensor] = []
        self.lock = threading.Lock()

    def take(self, size: int) -> Tensor:
        """A flat float32 buffer of at least ``size`` elements, reused where one is free."""
        with self.lock:
            fitting = [i for i, buffer in enumerate(self.free) if buffer.numel() >= size]
            if fitting:  # the smallest that fits
                return self.free.pop(min(fitting, key=lambda i: self.free[i].numel()))
        return torch.empty(size)

    def give_back(self, buffers: list[Tensor]) -> None:
        with self.lock:
            self.free = sorted(self.free + buffers, key=Tensor.numel, reverse=True)[:self.keep]


BUFFERS = BufferPool()


class IndexedDecoderCache:
    """Every decoder layer's keys and values on CPU, for nmt's C kernels (nmt/models/cpu_kernels.py),
    which read them through ``history`` rather than have them moved.

    A step writes its position of every row into slots 0..rows-1 of that position's block; a reorder
    (surviving beams, sentences leaving) rewrites only ``history`` (positions, rows), the slot of each
    row's ancestor at each position, which all layers share: no key or value is ever copied. A buffer
    is (capacity, slots, 2, heads, head_dim), with room for what search reserves up front, taken from
    :data:`BUFFERS` and given back when the cache is collected.
    """

    def __init__(self, num_layers: int):
        self.layers = [IndexedKeyValueCache(self) for _ in range(num_layers)]
        self.storage: list[Tensor] = []  # the layers' flat buffers, given back to BUFFERS at the end
        weakref.finalize(self, BUFFERS.give_back, self.storage)
        self.history: Tensor | None = None  # (capacity, rows) int32
        self.positions = 0  # positions that history has
        self.reserved = (0, 0)  # positions, rows

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reserve(self, positions: int, rows: int) -> None:
        self.reserved = (positions, rows)

    def extend_history(self, positions: int, rows: int) -> None:
        """Positions up to ``positions`` of ``rows`` rows each: a new position's row r is in slot r."""
        if self.history is None:
            self.history = torch.empty(max(positions, self.reserved[0]), rows, dtype=torch.int32)
        elif self.history.size(1) != rows:
            raise ValueError(f"{rows} rows appended to a cache reordered to {self.history.size(1)}")
        elif self.history.size(0) < positions:
            grown = torch.empty(int(GROWTH * positions), rows, dtype=torch.int32)
            grown[:self.positions] = self.history[:self.positions]
            self.history = grown
        if self.positions < positions:
            self.history[self.positions:positions] = torch.arange(rows, dtype=torch.int32)
            self.positions = positions

    def reorder(self, indices: Tensor) -> None:
        """Row i becomes old row ``indices[i]``: its history is that row's."""
        if self.history is None:
            return
        reordered = torch.empty(self.history.size(0), len(indices), dtype=torch.int32)
        torch.index_select(self.history[:self.positions], 1, indices, out=reordered[:self.positions])
        self.history = reordered


class IndexedKeyValueCache:
    """One layer's keys and values in an :class:`IndexedDecoderCache`."""

    computes_attention = True  # the layer asks it for attention (attend), not for its keys and values

    def __init__(self, owner: IndexedDecoderCache):
        self.owner = owner
        self.length = 0
        self.buffer: Tensor | None = None  # (capacity, slots, 2, heads, head_dim) float32

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Add new positions, given as (rows, heads, new, head_dim)."""
        rows, heads, new, head_dim = keys.shape
        end = self.length + new
        if self.buffer is None or self.buffer.size(0) < end or self.buffer.size(1) < rows:
            positions, slots = self.owner.reserved
            if self.buffer is not None:  # earlier positions keep their slots
                slots = max(slots, self.buffer.size(1))
            shape = (max(positions, int(GROWTH * end)), max(slots, rows), 2, heads, head_dim)
            flat = BUFFERS.take(math.prod(shape))  # only what history points to is ever read
            grown = flat[:math.prod(shape)].view(shape)
            if self.buffer is not None:
                grown[:self.length, :self.buffer.size(1)] = self.buffer[:self.length]
            self.owner.storage.append(flat)
            self.buffer = grown
        if new == 1:
            append_position(self.buffer, self.length, keys, values)
        else:
            self.buffer[self.length:end, :rows, 0] = keys.permute(2, 0, 1, 3)
            self.buffer[self.length:end, :rows, 1] = values.permute(2, 0, 1, 3)
        self.owner.extend_history(end, rows)
        self.length = end

    def attend(self, query: Tensor) -> Tensor:
        """Attention of one query per row (rows, 1, heads, head_dim) over every position so far."""
        rows, _, heads, head_dim = query.shape
        out = self_attention(self.buffer, self.owner.history, self.length, query.view(rows, heads, head_dim))
        return out.view(rows, 1, heads, head_dim)

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """Every row's keys and values so far as (rows, heads, length, head_dim), gathered: for steps
        of several new positions, which the kernel does not take."""
        slots = self.owner.history[:self.length].long()  # (length, rows)
        gathered = self.buffer[torch.arange(self.length).unsqueeze(1), slots]  # (length, rows, 2, heads, head_dim)
        both = gathered.permute(2, 1, 3, 0, 4)
        return both[0], both[1]
