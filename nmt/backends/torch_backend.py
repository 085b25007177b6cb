"""What decoding computes with: the interface every backend implements, in PyTorch's operations.

The model (nmt/models/transformer.py) and beam search (nmt/generation/search.py) call a backend
for everything that a faster implementation may do differently: attention (each sentence's queries
over its own keys, and the decoder's over its cache), the cache and its reordering, the encoder
output of the sentences still searched, the output projection onto each sentence's candidates, the
log-softmax and the top-k. :class:`TorchBackend` is that interface and its plain implementation:
the one training uses (its model never gets another), and decoding on a GPU, or on a CPU where
nmt's C kernels are turned off or cannot be built. nmt/backends/cpu_backend.py is the other.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmt.backends.kv_cache import DecoderCache, KeyValueCache

# cuDNN's attention kernel builds an execution plan per input shape. Length-bucketed batches and
# step-by-step decoding make nearly every call a new shape: with it, bf16 training ran 4x and bf16
# beam search 15x slower than without it on an H100 (docs/performance.md). The others have no such cost.
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
ENCODE_CHUNK = 256  # source tokens (padding included) encoded at once when decoding on CPU: see TorchBackend.encode
BLOCK = 64  # vocabulary entries per block in select_top: 3.4x faster than one top-k over all (600 rows x 8,000)
NEG_INF = float("-inf")

# The padding mask and each decoder layer's cross-attention keys and values.
Encoded = tuple[Tensor, tuple[tuple[Tensor, Tensor], ...]]


class TorchBackend:
    """Decoding's operations in PyTorch. Every method is part of the interface; another backend
    overrides those it does faster and inherits the rest."""

    def describe(self) -> str:
        return "PyTorch's operations"

    def attention(self, query: Tensor, keys_values: Any, mask: Tensor | None = None, is_causal: bool = False,
                  dropout: float = 0.0) -> Tensor:
        """softmax(q k^T / sqrt(d)) v for queries (B, heads, T, head_dim) over keys and values (B, heads,
        S, head_dim): a pair here (another backend's select_sentences may keep them otherwise); ``mask`` is
        boolean, broadcastable to (B, heads, T, S), True where attention is allowed."""
        key, value = keys_values
        return scaled_dot_product(query, key, value, mask, is_causal, dropout)

    def encode(self, encode_sentences: Callable[[Tensor], Encoded], src_tokens: Tensor) -> Encoded:
        """The encoder's output for decoding, by ``encode_sentences`` (the model's, for some sentences).

        On CPU, the cross-attention's keys and values are widened to fp32 once, here, contiguous:
        decoding's steps attend in fp32 there (cpu_attention_in_fp32) and nmt's kernels read them so.
        And under inference mode a batch is encoded a few sentences at a time (ENCODE_CHUNK tokens):
        the layers' temporaries are then a chunk's, not the batch's, which lowered decoding's peak
        memory at no cost in time (benchmarks/notes/amd-epyc-zen5.md). Each sentence keeps its padding."""
        if src_tokens.device.type != "cpu":
            return encode_sentences(src_tokens)

        def encode_in_fp32(sentences: Tensor) -> Encoded:
            padding_mask, memory = encode_sentences(sentences)
            return padding_mask, tuple((k.float().contiguous(), v.float().contiguous()) for k, v in memory)

        if not torch.is_inference_mode_enabled() or src_tokens.numel() <= ENCODE_CHUNK:
            return encode_in_fp32(src_tokens)
        chunks = [encode_in_fp32(chunk) for chunk in src_tokens.split(max(1, ENCODE_CHUNK // src_tokens.size(1)))]
        memory = tuple(tuple(torch.cat([chunk[1][layer][i] for chunk in chunks]) for i in (0, 1))
                       for layer in range(len(chunks[0][1])))
        return torch.cat([chunk[0] for chunk in chunks]), memory

    def new_cache(self, layers: int) -> DecoderCache:
        """An empty self-attention cache for ``layers`` decoder layers."""
        return DecoderCache(layers)

    def cache_row_bytes(self, layers: int, width: int, positions: int, dtype: torch.dtype, device_type: str) -> int:
        """What one row (a hypothesis) of ``positions`` positions takes in new_cache's cache, for ``layers``
        layers of keys and values of ``width`` computed in ``dtype`` on ``device_type`` (the server's
        batch memory estimate: nmt/serving/budget.py). fp32 on CPU (see KeyValueCache.dtype)."""
        itemsize = 4 if device_type == "cpu" else dtype.itemsize
        return DecoderCache.row_bytes(layers, width, positions, itemsize, reserved=device_type == "cpu")

    def encoder_output_copies(self) -> int:
        """How many copies of a batch's encoder output decoding may hold at once: two, as select_sentences
        copies the rows of the sentences that stay while the old ones are still held."""
        return 2

    def cached_attention(self, query: Tensor, keys: Tensor, values: Tensor, cache: KeyValueCache) -> Tensor:
        """Self-attention of new positions (queries, keys and values: rows, heads, new, head_dim) over
        every position so far, their own included (causally), after appending theirs to ``cache``
        (one layer's of new_cache's)."""
        past = cache.length
        keys, values = cache.append(keys, values)
        return attend_new_positions(query, keys, values, past)

    def select_sentences(self, encoder_out: Any, indices: Tensor) -> Any:
        """The encoder output (nmt.models.transformer.EncoderOut) of some sentences: row i becomes old
        row ``indices[i]`` (search: as sentences leave the batch). Copied here, once, rather than read
        through row numbers at every step."""
        padding_mask, memory, output = encoder_out
        return encoder_out._replace(padding_mask=padding_mask.index_select(0, indices),
                                    memory=tuple((k.index_select(0, indices), v.index_select(0, indices))
                                                 for k, v in memory),
                                    output=None if output is None else output.select(indices))

    def column_projection(self, output: nn.Module | Tensor, columns: Tensor) -> ColumnProjection:
        """The output projection (a layer, or a weight (vocabulary, dim)) onto each sentence's
        ``columns`` (sentences, width: vocabulary ids), made once per batch: the rows of the weight
        for the union of the batch's columns (int8 as quantized, bf16 as autocast would cast them),
        so that every step multiplies by a smaller matrix and casts nothing."""
        union, where = torch.unique(columns, return_inverse=True)
        if not isinstance(output, (Tensor, nn.Linear)):  # an int8 layer (nmt/backends/int8.py): its rows' layer
            return ColumnProjection(output.rows(union), where)
        weight = (output.weight if isinstance(output, nn.Linear) else output).index_select(0, union)
        if torch.is_autocast_enabled(weight.device.type):
            weight = weight.to(torch.get_autocast_dtype(weight.device.type))
        return ColumnProjection(functools.partial(F.linear, weight=weight), where)

    def log_softmax_(self, logits: Tensor, banned: Tensor | None, sentences: Tensor) -> Tensor:
        """In place, each row of ``logits`` (rows, columns) to log-probabilities over the columns it may
        choose: the rows belong to ``sentences`` (as many rows each), and with ``banned`` (sentences of
        the batch, columns: 0 or -inf) lose their sentence's -inf columns."""
        if banned is not None:
            logits.view(len(sentences), -1, logits.size(1)).add_(banned[sentences].unsqueeze(1))
        return torch.log_softmax(logits, dim=-1, out=logits)

    def select_top(self, scores: Tensor, logprobs: Tensor, beam: int) -> tuple[Tensor, Tensor, Tensor]:
        """Beam search: the 2*beam best (score, beam, token) continuations per sentence, best first.

        ``scores`` (sentences, width) are the rows' cumulative log-probabilities and ``logprobs``
        (sentences * width, vocab) their next tokens'. A continuation's score is the sum of the two.
        Rather than summing and ranking all width x vocab of them, each row's vocabulary is cut into
        blocks of BLOCK tokens: the 2*beam best continuations lie in the 2*beam blocks with the best
        maxima (a block holding one of them has a maximum at least as good, and 2*beam better maxima
        would be 2*beam better continuations), so only those blocks are searched.
        """
        sentences, width = scores.shape
        rows, vocab = logprobs.shape
        # A NaN (a row whose model overflowed) is a dead continuation, as in C: topk would rank it first.
        logprobs = torch.nan_to_num(logprobs, nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
        whole = vocab // BLOCK * BLOCK
        maxima = logprobs[:, :whole].view(rows, vocab // BLOCK, BLOCK).amax(dim=2)
        if whole < vocab:
            maxima = torch.cat([maxima, logprobs[:, whole:].amax(dim=1, keepdim=True)], dim=1)
        blocks = maxima.size(1)
        maxima = (maxima + scores.view(rows, 1)).view(sentences, width * blocks)
        top_blocks = maxima.topk(min(2 * beam, width * blocks), dim=1).indices  # (sentences, count)
        block_rows = top_blocks // blocks + (torch.arange(sentences, device=scores.device) * width).unsqueeze(1)
        columns = (top_blocks % blocks).unsqueeze(2) * BLOCK + torch.arange(BLOCK, device=scores.device)
        tokens = columns.clamp(max=vocab - 1)  # the last block may be short: its missing columns score -inf
        values = logprobs[block_rows.unsqueeze(2), tokens] + scores.view(rows)[block_rows].unsqueeze(2)
        values = values.masked_fill(columns >= vocab, NEG_INF).view(sentences, -1)
        best, where = values.topk(min(2 * beam, values.size(1)), dim=1)
        beams = (top_blocks // blocks).gather(1, where // BLOCK)
        tokens = tokens.view(sentences, -1).gather(1, where)
        if best.size(1) < 2 * beam:  # a tiny vocabulary: dead (-inf) candidates fill the beam, as -inf beams do
            missing = 2 * beam - best.size(1)
            best = F.pad(best, (0, missing), value=NEG_INF)
            beams, tokens = (F.pad(t, (0, missing)) for t in (beams, tokens))
        return best, beams, tokens


TORCH = TorchBackend()


class ColumnProjection:
    """The output projection onto each sentence's own vocabulary entries (its shortlist candidates):
    logits (rows, ..., width) for ``columns`` (sentences, width), each sentence's rows consecutive.

    The product runs over the union of the batch's columns (``project``), and each row then takes
    its sentence's columns from it (``where``: their positions in the union)."""

    def __init__(self, project: Callable[[Tensor], Tensor], where: Tensor):
        self.project, self.where = project, where

    def __call__(self, x: Tensor) -> Tensor:
        logits = self.project(x)
        sentences, width = self.where.shape
        grouped = logits.reshape(sentences, -1, logits.size(-1))
        index = self.where[:, None, :].expand(sentences, grouped.size(1), width)
        return grouped.gather(2, index).view(*logits.shape[:-1], width)

    def select(self, sentences: Tensor) -> ColumnProjection:
        """The projection for some sentences only (beam search: when sentences leave the batch)."""
        return ColumnProjection(self.project, self.where[sentences])


def attend_new_positions(query: Tensor, keys: Tensor, values: Tensor, past: int) -> Tensor:
    """Queries of new positions over the keys and values of ``past`` positions and their own, causally."""
    new = query.size(2)
    if new == 1:
        return scaled_dot_product(query, keys, values)
    if past == 0:
        return scaled_dot_product(query, keys, values, is_causal=True)
    return scaled_dot_product(query, keys, values, causal_mask(new, past, query.device))


def causal_mask(new: int, past: int, device: torch.device) -> Tensor:
    """Allowed-attention mask for ``new`` queries that follow ``past`` cached positions."""
    rows = torch.arange(new, device=device)[:, None] + past
    cols = torch.arange(past + new, device=device)[None, :]
    return cols <= rows


def scaled_dot_product(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                       is_causal: bool = False, dropout: float = 0.0) -> Tensor:
    """torch's scaled_dot_product_attention: in fp32 on CPU under bf16, and without cuDNN's kernel on CUDA."""
    if query.device.type == "cpu" and query.dtype == torch.bfloat16:
        return cpu_attention_in_fp32(query, key, value, mask, is_causal, dropout)
    with sdpa_kernel(CUDA_BACKENDS) if query.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal,
                                              dropout_p=dropout)


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
