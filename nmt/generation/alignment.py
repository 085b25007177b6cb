"""Word alignments from cross-attention, for ``--print-alignment`` and ``--print-attention``.

The model works on sentencepiece pieces; users align words. A piece that starts with "▁" opens
a word (the words of the detokenized text, split at spaces), the others continue it. The soft
word-to-word weight is the mean, over a target word's pieces, of the attention they give to a
source word's pieces (summed); the hard alignment links each target word to its heaviest source
word, as fairseq links each target piece to the source piece it attends to most. EOS is left
out on both sides. Positions count from 0, source first: ``srcpos-tgtpos``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from nmt.data.batching import collate
from nmt.models.attention_maps import attention_maps

WORD_START = "\u2581"  # sentencepiece's "▁"


def word_ids(pieces: list[str]) -> list[int]:
    """The word each piece belongs to (a piece opens a word when it starts with "▁", or is first)."""
    ids, word = [], -1
    for position, piece in enumerate(pieces):
        if position == 0 or piece.startswith(WORD_START):
            word += 1
        ids.append(word)
    return ids


def words(pieces: list[str]) -> list[str]:
    """The words the pieces spell, without sentencepiece's "▁" markers."""
    spelled: list[str] = []
    for piece, word in zip(pieces, word_ids(pieces)):
        if word == len(spelled):
            spelled.append("")
        spelled[word] += piece.replace(WORD_START, "")
    return spelled


def word_attention(attention: Tensor, source_pieces: list[str], target_pieces: list[str]) -> Tensor:
    """(target words, source words) soft attention from (target pieces, source pieces) probabilities.

    ``attention`` may still hold the EOS row and column (the last of each): they are dropped.
    """
    attention = attention[: len(target_pieces), : len(source_pieces)].float()
    source_words = torch.tensor(word_ids(source_pieces), dtype=torch.long)
    target_words = torch.tensor(word_ids(target_pieces), dtype=torch.long)
    rows = int(target_words.max()) + 1 if len(target_pieces) else 0
    cols = int(source_words.max()) + 1 if len(source_pieces) else 0
    to_source_words = torch.zeros(attention.size(0), cols).index_add_(1, source_words, attention)
    summed = torch.zeros(rows, cols).index_add_(0, target_words, to_source_words)
    pieces_per_word = torch.bincount(target_words, minlength=rows).clamp(min=1).unsqueeze(1)
    return summed / pieces_per_word


@dataclass
class WordAttention:
    """One translation's attention to its source, word by word (EOS left out)."""

    source_words: list[str]
    target_words: list[str]
    weights: Tensor  # (target words, source words)

    def alignment(self) -> str:
        return format_alignment(hard_alignment(self.weights))

    def to_json(self) -> dict:
        return {"source": self.source_words, "target": self.target_words,
                "attention": [[round(w, 4) for w in row] for row in self.weights.tolist()]}


def hard_alignment(soft: Tensor) -> list[tuple[int, int]]:
    """(source word, target word) pairs: each target word linked to the source word it attends to most."""
    if soft.numel() == 0:
        return []
    return [(int(source), target) for target, source in enumerate(soft.argmax(dim=1).tolist())]


def format_alignment(pairs: list[tuple[int, int]]) -> str:
    """fairseq's and Moses's ``srcpos-tgtpos`` pairs, separated by spaces."""
    return " ".join(f"{source}-{target}" for source, target in pairs)


def cross_attention(model: nn.Module, sources: list[np.ndarray], targets: list[list[int]], layer: int,
                    device: torch.device, batch_size: int = 64) -> list[Tensor]:
    """For each (source, target) pair, one decoder layer's cross-attention averaged over its heads.

    One teacher-forced pass per batch of pairs, after search: the search itself never pays for
    attention weights. Each matrix is (target tokens, source tokens), EOS included on both sides.
    """
    if not -len(model.decoder_layers) <= layer < len(model.decoder_layers):
        raise ValueError(f"layer {layer} out of range for {len(model.decoder_layers)} decoder layers")
    matrices: list[Tensor] = []
    for start in range(0, len(sources), batch_size):
        chunk = range(start, min(start + batch_size, len(sources)))
        batch = collate(list(chunk), [sources[i] for i in chunk],
                        [np.asarray(targets[i], dtype=np.int64) for i in chunk]).to(device)
        heads_mean = attention_maps(model, batch.source, batch.prev_output).cross[layer].mean(dim=1).cpu()
        for row, i in enumerate(chunk):
            matrices.append(heads_mean[row, : len(targets[i]), : len(sources[i])])
    return matrices


def word_attentions(model: nn.Module, vocabs, sources: list[np.ndarray], targets: list[list[int]], layer: int,
                    device: torch.device) -> list[WordAttention]:
    """Word-level attention of each target (token ids ending in EOS) to its source, from one layer."""
    matrices = cross_attention(model, sources, targets, layer, device)
    result = []
    for source, target, matrix in zip(sources, targets, matrices):
        source_pieces = [vocabs.source.piece(int(i)) for i in source[:-1]]
        target_pieces = [vocabs.target.piece(int(i)) for i in target[:-1]]
        result.append(WordAttention(words(source_pieces), words(target_pieces),
                                    word_attention(matrix, source_pieces, target_pieces)))
    return result
