"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), and its archs.

Post-norm residual blocks by default (``LayerNorm(x + Dropout(Sublayer(x)))``), pre-norm as an
option; sinusoidal positions; embeddings scaled by sqrt(d_model) and tied with the output
projection. The decoder decodes incrementally with a cache of its keys and values; what computes
the attention, the cache and the other operations of decoding is the model's ``backend``
(nmt/backends/torch_backend.py: PyTorch's operations, unless a model prepared for decoding was given
another, nmt.generation.inference.prepare_model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.backends.torch_backend import TORCH, Encoded, TorchBackend
from nmt.errors import NmtError
from nmt.models.attention import MultiHeadAttention
from nmt.models.registry import register_arch, register_model


@dataclass(frozen=True)
class TransformerConfig:
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_model: int = 512
    ffn_dim: int = 2048
    heads: int = 8
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    normalize_before: bool = False
    # "all": source embedding = target embedding = output projection (joint vocabulary);
    # "decoder": target embedding = output projection; "none": three separate matrices.
    share_embeddings: Literal["all", "decoder", "none"] = "all"
    max_positions: int = 1024

    def validate(self) -> None:
        if self.d_model % self.heads:
            raise NmtError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")
        if self.d_model % 2:
            raise NmtError("d_model must be even for sinusoidal positions")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise NmtError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("encoder_layers", "decoder_layers", "d_model", "ffn_dim", "heads", "max_positions"):
            if getattr(self, name) < 1:
                raise NmtError(f"{name} must be positive, got {getattr(self, name)}")


class EncoderOut(NamedTuple):
    """What the decoder reads of the source. Each decoder layer's cross-attention keys and values
    are projected here, once per sentence, not once per decoding step or per beam reorder."""

    padding_mask: Tensor  # (B, S), True at padding
    # Per decoder layer: keys, values (B, heads, S, D/heads), as the backend keeps them (TorchBackend.attention).
    memory: tuple[Any, ...]
    output: Callable[[Tensor], Tensor] | None = None  # the projection onto each sentence's columns; None: all

    def sentences(self) -> int:
        return self.padding_mask.size(0)


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), as in the paper."""
    positions = torch.arange(length, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(positions * inv_freq)
    table[:, 1::2] = torch.cos(positions * inv_freq)
    return table


class Dropout(nn.Module):
    """Inverted dropout whose mask comes from ``torch.rand_like``.

    ``nn.Dropout`` draws its mask with ``bernoulli_``, which on one CPU took 20 ms per (4,096 x 256)
    activation against 8.5 ms for ``rand_like`` (about 3% of a training update there; the CPU and
    command are in docs/performance.md). Same distribution, another draw.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":  # elsewhere torch's fused kernel is the fast one (and keeps a 1-byte mask)
            return F.dropout(x, self.p, training=True)
        scaled_keep = torch.rand_like(x, dtype=torch.float32).ge_(self.p).mul_(1.0 / (1.0 - self.p))
        return x * scaled_keep.to(x.dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, activation_dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.activation = nn.ReLU()
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.activation_dropout = Dropout(activation_dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout(self.activation(self.fc1(x))))


class Residual(nn.Module):
    """One sub-layer's residual connection, post-norm or pre-norm."""

    def __init__(self, d_model: int, dropout: float, normalize_before: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.normalize_before = normalize_before

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.normalize_before:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.heads, c.attention_dropout)
        self.ffn = FeedForward(c.d_model, c.ffn_dim, c.activation_dropout)
        self.attn_block = Residual(c.d_model, c.dropout, c.normalize_before)
        self.ffn_block = Residual(c.d_model, c.dropout, c.normalize_before)

    def forward(self, x: Tensor, key_mask: Tensor, backend: TorchBackend) -> Tensor:
        def attend(h: Tensor) -> Tensor:
            return self.self_attn(h, self.self_attn.project_kv(h), mask=key_mask, backend=backend)

        return self.ffn_block(self.attn_block(x, attend), self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.heads, c.attention_dropout)
        self.cross_attn = MultiHeadAttention(c.d_model, c.heads, c.attention_dropout)
        self.ffn = FeedForward(c.d_model, c.ffn_dim, c.activation_dropout)
        self.self_block = Residual(c.d_model, c.dropout, c.normalize_before)
        self.cross_block = Residual(c.d_model, c.dropout, c.normalize_before)
        self.ffn_block = Residual(c.d_model, c.dropout, c.normalize_before)

    def forward(self, x: Tensor, memory: Any, memory_mask: Tensor, cache: Any,
                backend: TorchBackend) -> Tensor:
        """``memory``: this layer's of EncoderOut; ``cache``: this layer's of ``backend.new_cache`` (None:
        ``x`` is the whole target prefix)."""
        def self_attend(h: Tensor) -> Tensor:
            if cache is None:
                return self.self_attn(h, self.self_attn.project_kv(h), is_causal=True, backend=backend)
            return self.self_attn.attend_cached(h, cache, backend)

        def cross_attend(h: Tensor) -> Tensor:
            # Rows come in groups, one group per source sentence (its beams): each group's queries
            # attend to its source's keys together, which are stored once, not once per beam.
            count, new, dim = h.shape
            sentences = memory_mask.size(0)
            grouped = h.reshape(sentences, count // sentences * new, dim)
            out = self.cross_attn(grouped, memory, mask=memory_mask, backend=backend)
            return out.view(count, new, dim)

        x = self.self_block(x, self_attend)
        x = self.cross_block(x, cross_attend)
        return self.ffn_block(x, self.ffn)


@register_model("transformer")
class Transformer(nn.Module):
    config_class = TransformerConfig

    def __init__(self, config: TransformerConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int):
        super().__init__()
        config.validate()
        if config.share_embeddings == "all" and src_vocab_size != tgt_vocab_size:
            raise NmtError("share_embeddings=all needs a joint vocabulary "
                           f"(source has {src_vocab_size} entries, target {tgt_vocab_size})")
        self.config = config
        self.pad_id = pad_id
        self.embed_scale = math.sqrt(config.d_model)
        self.tgt_embed = self._embedding(tgt_vocab_size)
        self.src_embed = self.tgt_embed if config.share_embeddings == "all" else self._embedding(src_vocab_size)
        if config.share_embeddings == "none":
            self.output_proj = nn.Parameter(torch.empty(tgt_vocab_size, config.d_model))
            nn.init.normal_(self.output_proj, mean=0.0, std=config.d_model ** -0.5)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        # Pre-norm stacks end un-normalized; post-norm already ends in a LayerNorm.
        self.encoder_norm = nn.LayerNorm(config.d_model) if config.normalize_before else nn.Identity()
        self.decoder_norm = nn.LayerNorm(config.d_model) if config.normalize_before else nn.Identity()
        self.embed_dropout = Dropout(config.dropout)
        # Computed once (not sin/cos at every decoding step), sliced per call; not saved.
        self.register_buffer("positions", sinusoidal_positions(config.max_positions, config.d_model), persistent=False)
        self.output_layer: nn.Module | None = None  # see separate_output_layer
        # What decoding computes with; a model prepared for decoding may be given another
        # (nmt.generation.inference.prepare_model). Training's is always this one.
        self.backend: TorchBackend = TORCH

    def _embedding(self, vocab_size: int) -> nn.Embedding:
        embedding = nn.Embedding(vocab_size, self.config.d_model, padding_idx=self.pad_id)
        nn.init.normal_(embedding.weight, mean=0.0, std=self.config.d_model ** -0.5)
        nn.init.zeros_(embedding.weight[self.pad_id])
        return embedding

    def output_weight(self) -> Tensor:
        return self.output_proj if self.config.share_embeddings == "none" else self.tgt_embed.weight

    def separate_output_layer(self) -> None:
        """Give the output projection an ``nn.Linear`` of its own, for inference only.

        Tied or not, the projection is a plain matrix that int8's quantization, which swaps
        ``nn.Linear`` modules, cannot see; as a module it becomes int8 like the other linear layers.
        Training must keep the tie, so this copy is made after loading and never saved.
        """
        weight = self.output_weight().detach()
        self.output_layer = nn.Linear(weight.size(1), weight.size(0), bias=False, device=weight.device)
        self.output_layer.weight = nn.Parameter(weight.clone(), requires_grad=False)

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, offset: int = 0) -> Tensor:
        end = offset + tokens.size(1)
        if end > self.config.max_positions:
            raise NmtError(f"a sequence of {end} tokens is over the model's max_positions {self.config.max_positions}")
        return self.embed_dropout(embedding(tokens) * self.embed_scale + self.positions[offset:end])

    def encode(self, src_tokens: Tensor, columns: Tensor | None = None) -> EncoderOut:
        """The encoder's output for decoding, as the backend computes it (TorchBackend.encode). With
        ``columns`` (sentences, width: vocabulary ids), ``decode`` gives logits for each sentence's
        entries only."""
        padding_mask, memory = self.backend.encode(self.encode_sentences, src_tokens)
        if columns is None:
            return EncoderOut(padding_mask, memory)
        output = self.output_layer if self.output_layer is not None else self.output_weight()
        return EncoderOut(padding_mask, memory, self.backend.column_projection(output, columns))

    def encode_sentences(self, src_tokens: Tensor) -> Encoded:
        """The padding mask and each decoder layer's cross-attention keys and values (of the encoder's states)."""
        padding_mask = src_tokens.eq(self.pad_id)
        key_mask = ~padding_mask[:, None, None, :]
        x = self._embed(self.src_embed, src_tokens)
        for layer in self.encoder_layers:
            x = layer(x, key_mask, self.backend)
        states = self.encoder_norm(x)
        return padding_mask, tuple(layer.cross_attn.project_kv(states) for layer in self.decoder_layers)

    def decode(self, prev_output_tokens: Tensor, encoder_out: EncoderOut, cache: Any = None,
               features_only: bool = False) -> Tensor:
        """Logits for each given target position (or, features_only, the states they are projected from).

        Without a cache, ``prev_output_tokens`` is the whole (teacher-forced) prefix. With one,
        it holds only the new tokens, which continue the positions already cached. Its rows may be
        k times the encoder's: k consecutive rows per sentence (beam search's beams). Training asks
        for the states: its loss projects them itself (nmt/training/loss.py).
        """
        if prev_output_tokens.size(0) % encoder_out.sentences():
            raise ValueError(f"{prev_output_tokens.size(0)} decoder rows for {encoder_out.sentences()} "
                             "sentences: each sentence needs the same number of rows")
        offset = cache.length if cache is not None else 0
        x = self._embed(self.tgt_embed, prev_output_tokens, offset)
        memory_mask = ~encoder_out.padding_mask[:, None, None, :]
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, encoder_out.memory[i], memory_mask, cache.layers[i] if cache is not None else None,
                      self.backend)
        x = self.decoder_norm(x)
        if features_only:
            return x
        if encoder_out.output is not None:
            return encoder_out.output(x)
        return self.output_layer(x) if self.output_layer is not None else F.linear(x, self.output_weight())

    def forward(self, src_tokens: Tensor, prev_output_tokens: Tensor, features_only: bool = False) -> Tensor:
        """Training's (and attention maps') teacher-forced pass: the whole batch encoded at once."""
        encoder_out = EncoderOut(*self.encode_sentences(src_tokens))
        return self.decode(prev_output_tokens, encoder_out, features_only=features_only)

    def new_cache(self) -> Any:
        """An empty cache of the decoder's keys and values (the backend's) for incremental decoding."""
        return self.backend.new_cache(len(self.decoder_layers))

    def reorder_encoder_out(self, encoder_out: EncoderOut, indices: Tensor) -> EncoderOut:
        """Rows for other sentences (beam search: when sentences leave the batch): TorchBackend.select_sentences."""
        return self.backend.select_sentences(encoder_out, indices)


@register_arch("transformer", "transformer_base")
def transformer_base() -> TransformerConfig:
    return TransformerConfig()


@register_arch("transformer", "transformer_big")
def transformer_big() -> TransformerConfig:
    """The paper's big model with its EN-DE dropout."""
    return TransformerConfig(d_model=1024, ffn_dim=4096, heads=16, dropout=0.3)


@register_arch("transformer", "transformer_big_en_fr")
def transformer_big_en_fr() -> TransformerConfig:
    return TransformerConfig(d_model=1024, ffn_dim=4096, heads=16, dropout=0.1)


@register_arch("transformer", "transformer_small")
def transformer_small() -> TransformerConfig:
    """For one CPU machine and small corpora (Multi30k)."""
    return TransformerConfig(encoder_layers=3, decoder_layers=3, d_model=256, ffn_dim=1024, heads=4, dropout=0.1)


@register_arch("transformer", "transformer_multi30k")
def transformer_multi30k() -> TransformerConfig:
    """Narrow and deep for ~30k sentence pairs: the shape Wu et al. (2021) use on Multi30k."""
    return TransformerConfig(encoder_layers=4, decoder_layers=4, d_model=128, ffn_dim=256, heads=4, dropout=0.3)


@register_arch("transformer", "transformer_tiny")
def transformer_tiny() -> TransformerConfig:
    """For tests and the demo: trains in seconds on a CPU."""
    return TransformerConfig(encoder_layers=2, decoder_layers=2, d_model=64, ffn_dim=128, heads=4, dropout=0.1)
