"""What ``nmt generate`` writes: plain translations, or fairseq-like S-/T-/H-/D-/P- lines.

Plain: one detokenized translation per line, ``nbest`` lines per input line, in input order
(``--print-scores`` puts the length-normalized score and a tab first). Fairseq: per input
``S-i`` source, ``T-i`` reference (binarized splits), then per hypothesis ``H-i`` score and
sentencepiece pieces, ``D-i`` score and detokenized text, ``P-i`` each token's log-probability
(EOS included). Scores are natural-log probabilities.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from nmt.checkpoint.format import Vocabularies
from nmt.files import atomic_write
from nmt.generation.alignment import WordAttention
from nmt.generation.search import Hypothesis


@dataclass
class Translation:
    index: int  # line number in the input, from 0
    source: str
    hypotheses: list[Hypothesis]  # nbest, best first
    reference: str | None = None
    attention: list[WordAttention] | None = None  # per hypothesis, with --print-alignment/--print-attention

    def best(self, vocabs: Vocabularies) -> str:
        return vocabs.target.decode(self.hypotheses[0].tokens)


def format_translation(t: Translation, vocabs: Vocabularies, style: str = "plain", print_scores: bool = False
                       ) -> list[str]:
    alignments = [a.alignment() for a in t.attention] if t.attention else None
    if style == "fairseq":
        lines = [f"S-{t.index}\t{t.source}"]
        if t.reference is not None:
            lines.append(f"T-{t.index}\t{t.reference}")
        for rank, h in enumerate(t.hypotheses):
            pieces = " ".join(vocabs.target.piece(i) for i in h.tokens[:-1])
            text = vocabs.target.decode(h.tokens)
            lines += [f"H-{t.index}\t{h.score:.4f}\t{pieces}", f"D-{t.index}\t{h.score:.4f}\t{text}",
                      f"P-{t.index}\t" + " ".join(f"{s:.4f}" for s in h.positional_scores)]
            if alignments:
                lines.append(f"A-{t.index}\t{alignments[rank]}")
        return lines
    texts = [vocabs.target.decode(h.tokens) for h in t.hypotheses]
    if alignments:
        texts = [f"{text}\t{alignment}" for text, alignment in zip(texts, alignments)]
    if print_scores:
        return [f"{h.score:.4f}\t{text}" for h, text in zip(t.hypotheses, texts)]
    return texts


def write_translations(translations: list[Translation], vocabs: Vocabularies, output: str | None,
                       style: str = "plain", print_scores: bool = False) -> None:
    """To ``output`` atomically (a failed run leaves an old file whole), or to stdout."""
    lines = (line + "\n" for t in translations for line in format_translation(t, vocabs, style, print_scores))
    if output:
        with atomic_write(output) as handle:
            handle.writelines(lines)
    else:
        sys.stdout.writelines(lines)
        sys.stdout.flush()
