"""How much memory a batch of beam search may take: what sizes the server's batches.

The estimate is a sum of named terms, each taken from the part of nmt that allocates it, so that it
follows them when they change. Per row (a sentence's beam), up to its own longest output (a row
leaves the batch when its sentence is done):

- ``cache``: the decoder's keys and values, as the model's backend says its cache takes them
  (TorchBackend.cache_row_bytes: nmt/backends);
- ``search``: the search's own tensors and finished hypotheses (nmt.generation.search.row_bytes);
- ``step``: one decoding step's activations and attention scores.

Per sentence, padded to the longest source of the batch:

- ``encoder_output``: its cross-attention keys and values (fp32 on CPU), as many times as the
  backend may hold them at once (TorchBackend.encoder_output_copies), and one step's
  cross-attention scores for its beams;
- ``encoding``: while encoding, one layer's activations and attention scores;
- ``controls``: a sentence's prefix, constraints and bans (nmt/generation/constraints.py), padded to
  the largest of its batch (ControlShape): their token tensors (constraints with their KMP tables;
  8-byte ids) and one step's work on them, every row comparing its last tokens with every ban and,
  with constraints, every candidate (2 x beam, plus each row's best token and next constraint
  pieces) gathering its sentence's constraint pieces and tables. Nothing without controls.

Every term is an upper bound of what it counts, not of the allocator's slack; tests/test_serve.py
decodes the heaviest batch an estimate admits and compares the peak memory it took.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nmt.device import PRECISIONS
from nmt.generation.constraints import SentenceControls
from nmt.generation.search import row_bytes as search_row_bytes

FLOAT, LONG = 4, 8


@dataclass(frozen=True)
class LayerShape:
    """What the memory of one model depends on."""

    d_model: int
    ffn_dim: int
    heads: int
    decoder_layers: int
    vocab: int


@dataclass(frozen=True)
class ControlShape:
    """The size of a batch's controls, each count the largest of its sentences': what they are padded to."""

    prefix: int = 0  # pieces
    constraints: int = 0  # per sentence
    constraint_pieces: int = 0
    bans: int = 0
    ban_pieces: int = 0

    @classmethod
    def of(cls, controls: list[SentenceControls | None]) -> ControlShape:
        given = [c for c in controls if c]
        return cls(max((len(c.prefix) for c in given), default=0),
                   max((len(c.constraints) for c in given), default=0),
                   max((len(p) for c in given for p in c.constraints), default=0),
                   max((len(c.bans) for c in given), default=0),
                   max((len(p) for c in given for p in c.bans), default=0))


NO_CONTROLS = ControlShape()


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

    def sentence_terms(self, longest_source: int, beam: int, controls: ControlShape = NO_CONTROLS) -> dict[str, int]:
        """One sentence of the batch, beside its rows: the encoder output and its cross-attention, and its
        controls padded to ``controls``."""
        copies = self.backend.encoder_output_copies()
        return {
            "encoder_output": sum((copies * 2 * shape.decoder_layers * FLOAT * shape.d_model
                                   + beam * shape.heads * FLOAT) * longest_source for shape in self.shapes),
            "encoding": sum((6 * shape.d_model + shape.ffn_dim + shape.heads * longest_source) * longest_source * FLOAT
                            for shape in self.shapes),
            "controls": control_bytes(controls, beam),
        }

    def row(self, longest_output: int) -> int:
        return sum(self.row_terms(longest_output).values())

    def sentence(self, longest_source: int, beam: int, controls: ControlShape = NO_CONTROLS) -> int:
        return sum(self.sentence_terms(longest_source, beam, controls).values())

    def batch(self, output_limits: list[int], beam: int, longest_source: int,
              controls: ControlShape = NO_CONTROLS) -> int:
        """A whole batch: each sentence's rows up to its own longest output, every sentence padded to the longest
        source and the largest controls."""
        return sum(beam * self.row(limit) for limit in output_limits) + \
            len(output_limits) * self.sentence(longest_source, beam, controls)


def control_bytes(shape: ControlShape, beam: int) -> int:
    """One sentence's controls in a batch padded to ``shape``, at ``beam``: kept, and one step's work
    (twice: the temporaries of gathers and comparisons)."""
    count, pieces = shape.constraints, shape.constraint_pieces
    table = count * (pieces + 1) * pieces
    kept = (2 * shape.prefix + 3 * count * pieces + table + 3 * shape.bans * shape.ban_pieces) * LONG
    rows = beam * 2 * count * LONG  # each row's matched pieces and met constraints
    banning = beam * shape.bans * shape.ban_pieces * (LONG + 2)  # each row against each ban
    candidates = (2 * beam + beam * (count + 1)) if count else 0
    constraining = candidates * (count * pieces * (2 * LONG + 1) + table * LONG + 16 * LONG)
    return kept + rows + 2 * (banning + constraining)
