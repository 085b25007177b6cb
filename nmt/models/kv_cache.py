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
into existing storage. That is :class:`DecoderCache`, for torch's attention; at inference on a CPU
where nmt's C kernels could be built, :class:`IndexedDecoderCache` moves nothing at a reorder.
"""

from __future__ import annotations

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


BUFFERS = BufferPool()


class IndexedDecoderCache:
    """Every decoder layer's keys and values on CPU, for nmt's C kernels (nmt/models/cpu_kernels.py),
    which read them through the rows' histories (:class:`History`) rather than have them moved.

    A layer's buffer is a row of slots (slots, 2, heads, head_dim): a step appends a block of one
    slot per row, and a reorder (surviving beams, sentences leaving) rewrites only the history, which
    all layers share: no key or value is ever copied, and a block has as many slots as there were
    rows at its step. Buffers come from :data:`BUFFERS`, with room for what search reserves up front,
    and go back to it as soon as the cache is dropped (nothing here refers back to the cache).
    """

    def __init__(self, num_layers: int, dtype: torch.dtype = torch.float32):
        self.history = History()
        self.layers = [IndexedKeyValueCache(self.history, dtype) for _ in range(num_layers)]
        weakref.finalize(self, BUFFERS.give_back, self.history.buffers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reserve(self, positions: int, rows: int) -> None:
        self.history.reserved = positions * rows

    def reorder(self, indices: Tensor) -> None:
        """Row i becomes old row ``indices[i]``: its history is that row's."""
        self.history.reorder(indices)


class History:
    """Where each row's keys and values lie in every layer's buffer: position p's block begins at
    slot ``starts[p]``, and ``slots[p, r]`` is row r's ancestor's slot within it."""

    def __init__(self) -> None:
        self.slots: Tensor | None = None  # (capacity, rows) int32
        self.starts = torch.zeros(1, dtype=torch.int64)  # (capacity + 1,): block p is slots starts[p]..starts[p+1]
        self.positions = 0  # positions that slots and starts have
        self.reserved = 0  # slots a buffer has room for from the start
        self.buffers: list[Tensor] = []  # the layers' flat buffers, given back to BUFFERS at the end

    def add_positions(self, positions: int, rows: int) -> int:
        """Blocks for positions up to ``positions``, of ``rows`` slots each (row r writes slot r);
        returns the slots a buffer needs."""
        if self.slots is None:
            self.slots = torch.empty(max(positions, 1), rows, dtype=torch.int32)
        elif self.slots.size(1) != rows:
            raise ValueError(f"{rows} rows appended to a cache reordered to {self.slots.size(1)}")
        if self.slots.size(0) < positions:
            grown = torch.empty(int(GROWTH * positions), rows, dtype=torch.int32)
            grown[:self.positions] = self.slots[:self.positions]
            self.slots = grown
        if self.starts.numel() <= positions:
            self.starts = torch.cat([self.starts, self.starts.new_zeros(self.slots.size(0) + 1 - self.starts.numel())])
        for p in range(self.positions, positions):
            self.slots[p] = torch.arange(rows, dtype=torch.int32)
            self.starts[p + 1] = self.starts[p] + rows
        self.positions = max(self.positions, positions)
        return int(self.starts[self.positions])

    def reorder(self, indices: Tensor) -> None:
        if self.slots is None:
            return
        reordered = torch.empty(self.slots.size(0), len(indices), dtype=torch.int32)
        torch.index_select(self.slots[:self.positions], 1, indices, out=reordered[:self.positions])
        self.slots = reordered


class IndexedKeyValueCache:
    """One layer's keys and values in an :class:`IndexedDecoderCache`."""

    def __init__(self, history: History, dtype: torch.dtype = torch.float32):
        self.history = history
        self.dtype = dtype  # of the keys and values stored: float32, or bf16 (in float32 buffers, 2 per float)
        self.length = 0
        self.buffer: Tensor | None = None  # (slots, 2, heads, head_dim) of dtype

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Add new positions, given as (rows, heads, new, head_dim)."""
        rows, heads, new, head_dim = keys.shape
        first, end = self.length, self.length + new
        needed = self.history.add_positions(end, rows)  # the first layer to get there adds them for all
        starts = self.history.starts
        if self.buffer is None or self.buffer.size(0) < needed:
            slots = max(self.history.reserved, int(GROWTH * needed))
            per_float = 4 // self.dtype.itemsize  # bf16: two to each float32 of the pool's buffers
            flat = BUFFERS.take(-(-slots * 2 * heads * head_dim // per_float))
            # only what the history points to is ever read
            grown = flat.view(self.dtype)[:slots * 2 * heads * head_dim].view(slots, 2, heads, head_dim)
            if self.buffer is not None:
                written = int(starts[first])
                grown[:written] = self.buffer[:written]
            self.history.buffers.append(flat)
            self.buffer = grown
        if new == 1:
            append_position(self.buffer, int(starts[first]), keys, values)
        else:
            for p in range(first, end):
                block = self.buffer[int(starts[p]):int(starts[p + 1])]
                block[:, 0], block[:, 1] = keys[:, :, p - first], values[:, :, p - first]
        self.length = end

    def attend(self, query: Tensor) -> Tensor:
        """Attention of one query per row (rows, 1, heads, head_dim) over every position so far."""
        rows, _, heads, head_dim = query.shape
        out = self_attention(self.buffer, self.history.starts, self.history.slots, self.length,
                             query.view(rows, heads, head_dim))
        return out.view(rows, 1, heads, head_dim)

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """Every row's keys and values so far as (rows, heads, length, head_dim), gathered: for steps
        of several new positions, which the kernel does not take."""
        slots = self.history.starts[:self.length].unsqueeze(1) + self.history.slots[:self.length]  # (length, rows)
        both = self.buffer[slots].float().permute(2, 1, 3, 0, 4)  # (2, rows, heads, length, head_dim)
        return both[0], both[1]
