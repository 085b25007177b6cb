"""Decoding on a CPU in nmt's C kernels (kernels.c): the fast path, as one backend.

One-query attention is a few dozen multiply-adds per (row, head); torch's kernel pays a fixed cost
for each, and beam search with torch's operations copies the self-attention cache every step to
follow the surviving beams. Here the cache is never moved (indexed_cache.py: the kernels read it
through a table of each row's ancestors), the encoder's keys and values stay in place as sentences
leave (KeptRows: their row numbers change instead), each sentence's queries attend to its own source in one
kernel call, the int8 output projection multiplies each sentence's rows by its own candidates'
weights, and the log-softmax under a shortlist and beam search's top-k are one pass each
(docs/performance.md has the measurements). What the kernels do not take falls to
:class:`~nmt.backends.torch_backend.TorchBackend`, with the same results up to float rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from nmt.backends.indexed_cache import BufferPool, IndexedDecoderCache, IndexedKeyValueCache
from nmt.backends.int8 import Int8Linear
from nmt.backends.kernels import Kernels
from nmt.backends.torch_backend import ColumnProjection, TorchBackend, attend_new_positions


class KeptRows(NamedTuple):
    """One decoder layer's cross-attention keys and values (stored, heads, S, head_dim), left where they
    are as sentences leave: sentence i's are row ``rows[i]`` (None: row i)."""

    keys: Tensor
    values: Tensor
    rows: Tensor | None = None

    @classmethod
    def of(cls, keys_values: Any) -> KeptRows:
        return keys_values if isinstance(keys_values, KeptRows) else cls(*keys_values)

    def pair(self) -> tuple[Tensor, Tensor]:
        """Each sentence's keys and values, copied into rows of their own (TorchBackend's form)."""
        if self.rows is None:
            return self.keys, self.values
        return self.keys.index_select(0, self.rows), self.values.index_select(0, self.rows)


class CpuKernelsBackend(TorchBackend):
    """nmt's C kernels, for a model that decodes on this process's CPU. ``int8``: its layers are int8
    (nmt/backends/int8.py), whose keys and values are kept in bf16."""

    def __init__(self, kernels: Kernels, int8: bool = False):
        self.kernels, self.int8 = kernels, int8
        self.buffers = BufferPool()  # this backend's caches hand their buffers on to the next batch's

    def describe(self) -> str:
        return f"nmt's C kernels ({self.kernels.describe(int8=self.int8)})"

    def attention(self, query: Tensor, keys_values: Any, mask: Tensor | None = None, is_causal: bool = False,
                  dropout: float = 0.0) -> Tensor:
        """Under a padding mask (B, 1, 1, S) (the encoder's, and the cross-attention's, where each
        sentence's queries are grouped: beams x new positions), one kernel call."""
        kept = KeptRows.of(keys_values)
        sentences, length = query.size(0), kept.keys.size(2)
        if is_causal or dropout or mask is None or mask.dtype != torch.bool or mask.shape != (sentences, 1, 1, length):
            return super().attention(query, kept.pair(), mask, is_causal, dropout)
        out = self.kernels.grouped_attention(kept.keys, kept.values, mask.view(sentences, length),
                                             query.transpose(1, 2), kept.rows)
        return out.transpose(1, 2)

    def new_cache(self, layers: int) -> IndexedDecoderCache:
        """bf16 where the keys and values are no more exact than that already: projected by int8 layers
        (whose error is larger than bf16's rounding, 2^-9) or under bf16 autocast. It halves the
        cache's memory, and the kernel that reads it runs faster (docs/performance.md); fp32 otherwise."""
        bf16 = self.int8 or torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        return IndexedDecoderCache(layers, self.kernels, self.buffers, torch.bfloat16 if bf16 else torch.float32)

    def cache_row_bytes(self, layers: int, width: int, positions: int, dtype: torch.dtype, device_type: str) -> int:
        bf16 = self.int8 or dtype == torch.bfloat16  # as new_cache chooses
        return IndexedDecoderCache.row_bytes(layers, width, positions, 2 if bf16 else 4)

    def encoder_output_copies(self) -> int:
        return 1  # never copied: see select_sentences

    def cached_attention(self, query: Tensor, keys: Tensor, values: Tensor, cache: IndexedKeyValueCache) -> Tensor:
        """A decoding step (one new position) in the kernel; several new positions (a cache filled with a
        prefix at once) over the keys and values gathered from the cache."""
        cache.append(keys, values)
        new = query.size(2)
        if new == 1:
            return cache.attend(query)
        keys, values = cache.keys_values()
        return attend_new_positions(query, keys, values, cache.length - new)

    def select_sentences(self, encoder_out: Any, indices: Tensor) -> Any:
        """The padding mask and the output projection are taken for the sentences left; their keys and values
        stay where they are, read through row numbers (KeptRows)."""
        memory = []
        for layer in encoder_out.memory:
            kept = KeptRows.of(layer)
            memory.append(kept._replace(rows=indices if kept.rows is None else kept.rows.index_select(0, indices)))
        output = None if encoder_out.output is None else encoder_out.output.select(indices)
        return encoder_out._replace(padding_mask=encoder_out.padding_mask.index_select(0, indices),
                                    memory=tuple(memory), output=output)

    def column_projection(self, output: nn.Module | Tensor, columns: Tensor) -> ColumnProjection | Int8Columns:
        """An int8 layer on a CPU with AVX512-VNNI: the kernel multiplies each sentence's rows by its
        own candidates' weight rows (a few hundred, where the batch's union has thousands:
        docs/performance.md). Without VNNI the product onto the union (TorchBackend's, Int8Linear.rows)
        is taken."""
        if not (self.kernels.int8_vnni and isinstance(output, Int8Linear)):
            return super().column_projection(output, columns)
        weight = output.quantized
        counts = 1 + (columns[:, 1:] != columns[:, :-1]).sum(dim=1, dtype=torch.int32)
        return Int8Columns(self.kernels, weight.values, columns, weight.row_sums[columns], weight.scales[columns],
                           counts)

    def log_softmax_(self, logits: Tensor, banned: Tensor | None, sentences: Tensor) -> Tensor:
        return self.kernels.log_softmax_(logits, banned, sentences)

    def select_top(self, scores: Tensor, logprobs: Tensor, beam: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.kernels.select_top(scores, logprobs, 2 * beam)


class Int8Columns:
    """An int8 output projection onto each sentence's own candidates, in the kernel (ColumnProjection's
    interface): ``columns`` (sentences, width: vocabulary ids, ascending, a shorter list repeating its
    last), their weight rows' sums, and how many of each sentence's are its own (``counts``). Each
    row's activations get an int8 scale of their own."""

    def __init__(self, kernels: Kernels, weight: Tensor, columns: Tensor, column_sums: Tensor, column_scales: Tensor,
                 counts: Tensor):
        self.kernels, self.weight = kernels, weight
        self.columns, self.column_sums, self.column_scales, self.counts = columns, column_sums, column_scales, counts
        self.product = kernels.int8_column_product(weight, columns, column_sums, column_scales, counts)  # checked once

    def __call__(self, x: Tensor) -> Tensor:
        return self.product(x)

    def select(self, sentences: Tensor) -> Int8Columns:
        """The projection for some sentences only (beam search: when sentences leave the batch)."""
        return Int8Columns(self.kernels, self.weight, self.columns[sentences], self.column_sums[sentences],
                           self.column_scales[sentences], self.counts[sentences])
