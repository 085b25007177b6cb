"""The decoder's self-attention keys and values for nmt's C kernels: never moved at a reorder.

Beam search reorders the rows of the cache at every step (beams move, finished sentences leave).
Here that moves nothing: each layer's keys and values stay where a step wrote them, and one table
of every row's ancestry (:class:`History`), shared by all layers, says where each row's lie; the
kernels read them through it (kernels.c). Buffers come from a pool (:class:`BufferPool`) that
hands one batch's on to the next, their pages already faulted in.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from nmt.backends.kernels import Kernels
from nmt.backends.kv_cache import GROWTH


class BufferPool:
    """Flat float32 buffers that the caches of one batch hand on to the next batch's.

    A fresh buffer's pages are faulted in, and zeroed by the kernel, as positions are first written:
    a tenth of a CPU decoding's time (docs/performance.md). A reused buffer's pages are there already,
    and a batch only ever writes a prefix of it, so it holds no more memory than the largest batch
    needed. A cache takes buffers for itself (threads decoding at once never share one) and gives
    them back when it is collected; the pool keeps one cache's worth, and lets them all go when a
    batch needs larger ones (so that old and new are never held together).
    """

    def __init__(self) -> None:
        self.free: list[Tensor] = []
        self.returned: list[list[Tensor]] = []  # given back, not yet in free: see give_back
        self.lock = threading.Lock()

    def take(self, size: int) -> Tensor:
        """A flat float32 buffer of at least ``size`` elements, reused where one is free."""
        with self.lock:
            while self.returned:  # a cache's buffers, as one list: keep the largest of them and free's
                buffers = self.returned.pop()
                self.free = sorted(self.free + buffers, key=Tensor.numel, reverse=True)[:len(buffers)]
            fitting = [i for i, buffer in enumerate(self.free) if buffer.numel() >= size]
            if not fitting:
                self.free.clear()
                with torch.inference_mode(False):  # a normal tensor: decoding under no_grad may reuse it too
                    return torch.empty(size, dtype=torch.float32)
            return self.free.pop(min(fitting, key=lambda i: self.free[i].numel()))  # the smallest that fits

    def give_back(self, buffers: list[Tensor]) -> None:
        """Called when a cache is collected, which the garbage collector may do in any thread, even
        one inside ``take``: no lock here (appending to a list is atomic), take sorts them in."""
        self.returned.append(buffers)


class IndexedDecoderCache:
    """Every decoder layer's keys and values, which the kernels read through the rows' histories
    (:class:`History`) rather than have them moved.

    A layer's buffer is a row of slots (slots, 2, heads, head_dim): a step appends a block of one
    slot per row, and a reorder (surviving beams, sentences leaving) rewrites only the history, which
    all layers share: no key or value is ever copied, and a block has as many slots as there were
    rows at its step. Buffers come from ``pool``, with room for what search reserves up front, and go
    back to it as soon as the cache is dropped (nothing here refers back to the cache).
    """

    def __init__(self, num_layers: int, kernels: Kernels, pool: BufferPool, dtype: torch.dtype = torch.float32):
        self.history = History()
        self.layers = [IndexedKeyValueCache(self.history, kernels, pool, dtype) for _ in range(num_layers)]
        weakref.finalize(self, pool.give_back, self.history.buffers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reserve(self, positions: int, rows: int) -> None:
        self.history.reserved = positions * rows

    def reorder(self, indices: Tensor) -> None:
        """Row i becomes old row ``indices[i]``: its history is that row's."""
        self.history.reorder(indices)

    @staticmethod
    def row_bytes(layers: int, width: int, positions: int, itemsize: int) -> int:
        """The most one row of ``positions`` positions (keys and values of ``width`` each) takes: a slot
        per position in every layer's buffer (reserved up front, written as the row reaches it; a block
        has slots for the rows still searched only), and its column of the history, copied at a reorder."""
        return layers * positions * 2 * width * itemsize + int(2 * GROWTH * positions) * 4


class History:
    """Where each row's keys and values lie in every layer's buffer: position p's block begins at
    slot ``starts[p]``, and ``slots[p, r]`` is row r's ancestor's slot within it."""

    def __init__(self) -> None:
        self.slots: Tensor | None = None  # (capacity, rows) int32
        self.starts = torch.zeros(1, dtype=torch.int64)  # (capacity + 1,): block p is slots starts[p]..starts[p+1]
        self.offsets = [0]  # starts[:positions + 1] as Python numbers: read by every layer at every step
        self.positions = 0  # positions that slots and starts have
        self.reserved = 0  # slots a buffer has room for from the start
        self.buffers: list[Tensor] = []  # the layers' flat buffers, given back to the pool at the end

    def add_positions(self, positions: int, rows: int) -> int:
        """Blocks for positions up to ``positions``, of ``rows`` slots each (row r writes slot r);
        returns the slots a buffer needs."""
        if self.slots is None:
            self.slots = torch.empty(max(positions, 1), rows, dtype=torch.int32)
        elif self.slots.size(1) != rows:
            raise ValueError(f"{rows} rows appended to a cache reordered to {self.slots.size(1)}")
        if positions <= self.positions:  # the first layer to get there has added them
            return self.offsets[self.positions]
        if self.slots.size(0) < positions:
            grown = torch.empty(int(GROWTH * positions), rows, dtype=torch.int32)
            grown[:self.positions] = self.slots[:self.positions]
            self.slots = grown
        if self.starts.numel() <= positions:
            self.starts = torch.cat([self.starts, self.starts.new_zeros(self.slots.size(0) + 1 - self.starts.numel())])
        for p in range(self.positions, positions):
            self.slots[p] = torch.arange(rows, dtype=torch.int32)
            self.offsets.append(self.offsets[p] + rows)
            self.starts[p + 1] = self.offsets[p + 1]
        self.positions = positions
        return self.offsets[positions]

    def reorder(self, indices: Tensor) -> None:
        if self.slots is None:
            return
        reordered = torch.empty(self.slots.size(0), len(indices), dtype=torch.int32)
        torch.index_select(self.slots[:self.positions], 1, indices, out=reordered[:self.positions])
        self.slots = reordered


class IndexedKeyValueCache:
    """One layer's keys and values in an :class:`IndexedDecoderCache`."""

    def __init__(self, history: History, kernels: Kernels, pool: BufferPool, dtype: torch.dtype = torch.float32):
        self.history, self.kernels, self.pool = history, kernels, pool
        self.dtype = dtype  # of the keys and values stored: float32, or bf16 (in float32 buffers, 2 per float)
        self.length = 0
        self.buffer: Tensor | None = None  # (slots, 2, heads, head_dim) of dtype

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Add new positions, given as (rows, heads, new, head_dim)."""
        rows, heads, new, head_dim = keys.shape
        first, end = self.length, self.length + new
        needed = self.history.add_positions(end, rows)  # the first layer to get there adds them for all
        starts = self.history.offsets
        if self.buffer is None or self.buffer.size(0) < needed:
            slots = max(self.history.reserved, int(GROWTH * needed))
            per_float = 4 // self.dtype.itemsize  # bf16: two to each float32 of the pool's buffers
            flat = self.pool.take(-(-slots * 2 * heads * head_dim // per_float))
            # only what the history points to is ever read
            grown = flat.view(self.dtype)[:slots * 2 * heads * head_dim].view(slots, 2, heads, head_dim)
            if self.buffer is not None:
                written = starts[first]
                grown[:written] = self.buffer[:written]
            self.history.buffers.append(flat)
            self.buffer = grown
        if new == 1:
            self.kernels.append_position(self.buffer, starts[first], keys, values)
        else:
            for p in range(first, end):
                block = self.buffer[starts[p]:starts[p + 1]]
                block[:, 0], block[:, 1] = keys[:, :, p - first], values[:, :, p - first]
        self.length = end

    def attend(self, query: Tensor) -> Tensor:
        """Attention of one query per row (rows, heads, 1, head_dim) over every position so far."""
        rows, heads, _, head_dim = query.shape
        out = self.kernels.self_attention(self.buffer, self.history.starts, self.history.slots, self.length,
                                          query.reshape(rows, heads, head_dim))
        return out.view(rows, heads, 1, head_dim)

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """Every row's keys and values so far as (rows, heads, length, head_dim), gathered: for steps
        of several new positions, which the kernel does not take."""
        slots = self.history.starts[:self.length].unsqueeze(1) + self.history.slots[:self.length]  # (length, rows)
        both = self.buffer[slots].float().permute(2, 1, 3, 0, 4)  # (2, rows, heads, length, head_dim)
        return both[0], both[1]
