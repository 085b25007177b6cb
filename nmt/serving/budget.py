"""How much memory a batch of beam search may take: what sizes the server's batches.

The estimate is a sum of named terms, each taken from the part of nmt that allocates it, so that it
follows them when they change. Per row (a sentence's beam), up to its own longest output (a row
leaves the batch when its sentence is done):

- ``cache``: the decoder's keys and values, as the model's backend says its cache takes them
  (TorchBackend.cache_row_bytes: nmt/backends);
- ``search``: the search's own tensors and finished hypotheses (nmt.generation.search.row_bytes);
- ``step``: one decoding step's activations and attention scores.

Per sentence, padded to the longest source of the batch:

- ``encoder_output``: its encoder states and cross-attention keys and values (fp32 on CPU), as
  many times as the backend may hold them at once (TorchBackend.encoder_output_copies), and one
  step's cross-attention scores for its beams;
- ``encoding``: while encoding, one layer's activations and attention scores.

Every term is an upper bound of what it counts, not of the allocator's slack; tests/test_serve.py
decodes the heaviest batch an estimate admits and compares the peak memory it took.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nmt.device import PRECISIONS
from nmt.generation.search import row_bytes as search_row_bytes

FLOAT = 4


@dataclass(frozen=True)
class LayerShape:
    """What the memory of one model depends on."""

    d_model: int
    ffn_dim: int
    heads: int
    decoder_layers: int
    vocab: int


class SearchMemory:
    """Bytes a batch of beam search takes: ``row(longest_output)`` per row plus ``sentence(longest_source,
    beam)`` per sentence, for ``model`` (prepared for decoding: its backend's cache is counted) computing
    in ``precision`` on ``device_type``. An ensemble holds every model's caches and logits."""

    def __init__(self, model: nn.Module, precision: str, device_type: str):
        models = getattr(model, "models", [model])
        self.shapes = [LayerShape(m.config.d_model, m.config.ffn_dim, m.config.heads, m.config.decoder_layers,
                                  m.tgt_embed.num_embeddings) for m in models]
        self.backend = model.backend
        self.dtype = PRECISIONS[precision] or torch.float32
        self.device_type = device_type

    def row_terms(self, longest_output: int) -> dict[str, int]:
        """One row (a beam of one sentence) that may reach ``longest_output`` tokens (EOS excluded)."""
        positions = longest_output + 1  # BOS, then every token but the last
        return {
            "cache": sum(self.backend.cache_row_bytes(shape.decoder_layers, shape.d_model, positions, self.dtype,
                                                      self.device_type) for shape in self.shapes),
            "search": search_row_bytes(positions, self.shapes[0].vocab, len(self.shapes)),
            "step": sum((10 * shape.d_model + 2 * shape.ffn_dim + shape.heads * positions) * FLOAT
                        for shape in self.shapes),
        }

    def sentence_terms(self, longest_source: int, beam: int) -> dict[str, int]:
        """One sentence of the batch, beside its rows: the encoder output and its cross-attention."""
        copies, states = self.backend.encoder_output_copies(), self.dtype.itemsize
        return {
            "encoder_output": sum((copies * (states + 2 * shape.decoder_layers * FLOAT) * shape.d_model
                                   + beam * shape.heads * FLOAT) * longest_source for shape in self.shapes),
            "encoding": sum((6 * shape.d_model + shape.ffn_dim + shape.heads * longest_source) * longest_source * FLOAT
                            for shape in self.shapes),
        }

    def row(self, longest_output: int) -> int:
        return sum(self.row_terms(longest_output).values())

    def sentence(self, longest_source: int, beam: int) -> int:
        return sum(self.sentence_terms(longest_source, beam).values())

    def batch(self, output_limits: list[int], beam: int, longest_source: int) -> int:
        """A whole batch: each sentence's rows up to its own longest output, every sentence padded to the longest
        source."""
        return sum(beam * self.row(limit) for limit in output_limits) + \
            len(output_limits) * self.sentence(longest_source, beam)
