"""Corpus-level BLEU, chrF and TER with sacrebleu, and their reproducibility signatures.

sacrebleu's Python API zips hypotheses and references and silently scores the shorter stream,
so the line counts are checked here before anything is scored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

from nmt.errors import NmtError
from nmt.files import read_lines
from nmt.options import check_values

METRICS = ("bleu", "chrf", "ter")
STDIN = "-"


@dataclass(frozen=True)
class MetricResult:
    name: str  # sacrebleu's name: BLEU, chrF2, TER
    score: float
    signature: str  # e.g. nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0
    formatted: str  # sacrebleu's line: "BLEU|<signature> = 27.30 58.9/33.0/... (BP = ...)"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ScoreOptions:
    """The options of ``nmt score`` (and a recipe's ``score:`` section, where system and ref are filled in)."""

    system: str = field(metadata={"help": "Detokenized system output, one line per segment ('-' = stdin).",
                                  "flags": ["--sys"]})
    ref: list[str] = field(metadata={"help": "Reference file (repeat for several references); plain or .gz."})
    metrics: str = field(default="bleu", metadata={"help": f"Comma-separated metrics from {', '.join(METRICS)}."})
    lowercase: bool = field(default=False, metadata={"help": "Case-insensitive scores (sacrebleu's default is cased)."})
    json_output: bool = field(default=False, metadata={"help": "Print the scores as JSON.", "flags": ["--json"]})

    def __post_init__(self) -> None:
        check_values(self)
        parse_metrics(self.metrics)


def parse_metrics(text: str) -> list[str]:
    """`bleu,chrf,ter` -> ["bleu", "chrf", "ter"], with a clear error for unknown names."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise NmtError(f"unknown metric {', '.join(unknown) or repr(text)}; choose from {', '.join(METRICS)}")
    return list(dict.fromkeys(names))


def _metric(name: str, lowercase: bool):
    if name == "bleu":
        return BLEU(lowercase=lowercase)
    if name == "chrf":
        return CHRF(lowercase=lowercase)
    if name == "ter":
        return TER(case_sensitive=not lowercase)
    raise NmtError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")


def score(hypotheses: Sequence[str], references: Sequence[Sequence[str]], metrics: Sequence[str] = ("bleu",),
          lowercase: bool = False) -> list[MetricResult]:
    """Score detokenized hypotheses against one or more reference streams (sacrebleu defaults).

    ``references`` is a list of streams, each with one line per hypothesis.
    """
    if not references:
        raise NmtError("no reference given")
    if not hypotheses:
        raise NmtError("no hypotheses to score")
    for index, stream in enumerate(references, start=1):
        if len(stream) != len(hypotheses):
            raise NmtError(f"reference {index} has {len(stream)} lines but there are {len(hypotheses)} hypotheses")
    results = []
    for name in metrics:
        metric = _metric(name, lowercase)
        corpus_score = metric.corpus_score(list(hypotheses), [list(stream) for stream in references])
        signature = str(metric.get_signature())
        results.append(MetricResult(corpus_score.name, float(corpus_score.score), signature,
                                    corpus_score.format(signature=signature)))
    return results


def read_stream(path: str | Path) -> list[str]:
    """Lines of a file (plain or .gz), or of stdin for "-"; an empty file is an error."""
    lines = read_lines(path)
    if not lines:
        raise NmtError(f"{_name(path)} is empty")
    return lines


def _name(path: str | Path) -> str:
    return "stdin" if str(path) == STDIN else str(path)


def score_files(system: str | Path, references: Sequence[str | Path], metrics: Sequence[str] = ("bleu",),
                lowercase: bool = False) -> list[MetricResult]:
    """`nmt score`: read the system output and references, check their line counts, score."""
    if not references:
        raise NmtError("give at least one --ref")
    if sum(str(path) == STDIN for path in [system, *references]) > 1:
        raise NmtError("only one input can be read from stdin")
    hypotheses = read_stream(system)
    reference_streams = []
    for path in references:
        stream = read_stream(path)
        if len(stream) != len(hypotheses):
            raise NmtError(f"{_name(system)} has {len(hypotheses)} lines but {_name(path)} has {len(stream)}")
        reference_streams.append(stream)
    return score(hypotheses, reference_streams, metrics, lowercase)


def format_results(results: Sequence[MetricResult], as_json: bool = False) -> str:
    """sacrebleu's text lines (score with signature), or one JSON list."""
    if as_json:
        return json.dumps([result.to_dict() for result in results], ensure_ascii=False, indent=1)
    return "\n".join(result.formatted for result in results)
