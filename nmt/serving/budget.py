"""How much memory a batch of beam search may take, from the model's shape: what sizes the server's batches.

While a batch is searched it holds, per row (a sentence's beam): every decoder layer's keys and
values for each position the row may reach, in a buffer that doubles as it grows (from 16
positions), with a spare copy of the same size for reordering, and one layer at a time also
holding its old buffers while it grows; the tokens and scores so far and its finished
hypotheses; and one step's activations and logits. Per sentence, padded to the longest source
of the batch: its encoder states and cross-attention keys and values (copied once more when
sentences leave the batch), and while encoding, one layer's activations and attention scores.
A row leaves the batch when its sentence is done, by its own longest output at the latest, so
each row counts up to that output only.

Controls (nmt/generation/constraints.py) add, per sentence, their token tensors padded to the
sentence's batch (prefix, constraints and their KMP tables, bans: 8-byte ids) and each step's
work on them: every row compares its last tokens with every ban, and with constraints every
candidate (2 x beam, plus each row's best token and next constraint pieces) gathers its
sentence's constraint pieces and tables.

Every tensor counts 4 bytes a number (fp32, what the CPU cache keeps; bf16 on a GPU takes half),
so the estimate is an upper bound of what the search allocates, not of the allocator's slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from nmt.generation.constraints import SentenceControls

FLOAT, LONG = 4, 8
HYPOTHESIS_BYTES_PER_TOKEN = 12 * 2 + 80  # token id and score tensors (two copies while they grow), Python lists


@dataclass(frozen=True)
class LayerShape:
    """What the memory of one model depends on."""

    d_model: int
    ffn_dim: int
    heads: int
    decoder_layers: int
    vocab: int


def cache_capacity(positions: int) -> int:
    """The positions a KeyValueCache holds after ``positions`` appends: 16, doubled as needed."""
    return 16 if positions <= 16 else 16 * 2 ** math.ceil(math.log2(positions / 16))


class SearchMemory:
    """Bytes a batch of beam search takes: ``rows(longest_output)`` per row plus ``sentences(longest_source,
    beam)`` per sentence. An ensemble holds every model's caches and logits."""

    def __init__(self, model: nn.Module):
        self.shapes = [LayerShape(m.config.d_model, m.config.ffn_dim, m.config.heads, m.config.decoder_layers,
                                  m.tgt_embed.num_embeddings) for m in getattr(model, "models", [model])]

    def row(self, longest_output: int) -> int:
        """One row (a beam of one sentence) that may reach ``longest_output`` tokens (EOS excluded)."""
        positions = longest_output + 1  # BOS, then every token but the last
        capacity = cache_capacity(positions)
        models = len(self.shapes)
        total = positions * HYPOTHESIS_BYTES_PER_TOKEN + (2 * models + 3) * self.shapes[0].vocab * FLOAT
        for shape in self.shapes:
            total += (4 * shape.decoder_layers + 2) * capacity * shape.d_model * FLOAT  # keys, values, spares
            total += (10 * shape.d_model + 2 * shape.ffn_dim + shape.heads * capacity) * FLOAT  # one step
        return total

    def sentence(self, longest_source: int, beam: int) -> int:
        """One sentence of the batch, beside its rows: the encoder output and its cross-attention."""
        total = 0
        for shape in self.shapes:
            kept = 2 * (2 * shape.decoder_layers + 1) * longest_source * shape.d_model * FLOAT
            encoding = (6 * shape.d_model + shape.ffn_dim + shape.heads * longest_source) * longest_source * FLOAT
            total += kept + encoding + beam * shape.heads * longest_source * FLOAT
        return total

    def batch(self, output_limits: list[int], beam: int, longest_source: int) -> int:
        """A whole batch: each sentence's rows up to its own longest output, every sentence padded to the longest
        source."""
        return sum(beam * self.row(limit) for limit in output_limits) + \
            len(output_limits) * self.sentence(longest_source, beam)


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
