"""Corpus-level BLEU, chrF and TER with sacrebleu, and their reproducibility signatures.

sacrebleu's Python API zips hypotheses and references and silently scores the shorter stream,
so the line counts are checked here before anything is scored. BLEU's tokenizer defaults to
sacreBLEU's own choice for the target language (``zh``, ``ja-mecab``, ``ko-mecab``, else ``13a``):
13a splits no Chinese or Japanese words, so their BLEU would be meaningless.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

from nmt.errors import NmtError, install_hint
from nmt.files import read_lines
from nmt.options import check_values

METRICS = ("bleu", "chrf", "ter")
STDIN = "-"
AUTO = "auto"  # sacreBLEU's choice for the target language
BleuTokenizer = Literal[(AUTO, *BLEU.TOKENIZERS)]  # sacreBLEU's tokenizer names, from sacreBLEU itself
INSTALL_HINTS = {"ja-mecab": "ja", "ko-mecab": "ko"}  # tokenizers needing an extra (pyproject.toml)

_BY_LANGUAGE = ", ".join(f"{lang}: {name}" for lang, name in BLEU._TOKENIZER_MAP.items())
TOKENIZE_HELP = (f"BLEU tokenizer, sacreBLEU's names ({', '.join(BLEU.TOKENIZERS)}); auto: sacreBLEU's "
                 f"choice for the target language ({_BY_LANGUAGE}, others: {BLEU.TOKENIZER_DEFAULT}).")
LOWERCASE_HELP = "Case-insensitive scores, for comparison with lowercased results (sacreBLEU's default is cased)."


@dataclass(frozen=True)
class MetricOptions:
    """How hypotheses are compared with references: shared by `nmt score`, the recipe's ``score:``,
    ``generate --score-reference`` and ``train --eval-bleu`` (the last two know the target language)."""

    tokenize: BleuTokenizer = field(default=AUTO, metadata={"help": TOKENIZE_HELP})
    lowercase: bool = field(default=False, metadata={"help": LOWERCASE_HELP})
    language: str | None = field(default=None, metadata={
        "flags": ["--language", "-l"],
        "help": "Target language code, which picks the --tokenize for auto; unset: the last suffix of the "
                "first --ref file before .gz when it is 2-3 letters (newstest2014.ja, test.zh.gz)."})


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

    system: str = field(metadata={"path": True,
                                  "help": "Detokenized system output, one line per segment ('-' = stdin).",
                                  "flags": ["--sys"]})
    ref: list[str] = field(metadata={"path": True,
                                     "help": "Reference file (repeat for several references); plain or .gz."})
    metrics: str = field(default="bleu", metadata={"help": f"Comma-separated metrics from {', '.join(METRICS)}."})
    json_output: bool = field(default=False, metadata={"help": "Print the scores as JSON.", "flags": ["--json"]})
    metric: MetricOptions = field(default_factory=MetricOptions, metadata={"help": "How to compare."})

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


def bleu_metric(options: MetricOptions) -> BLEU:
    """sacreBLEU's BLEU as the options say; an NmtError when its tokenizer cannot be set up here."""
    if options.tokenize not in typing.get_args(BleuTokenizer):
        raise NmtError(f"unknown BLEU tokenizer {options.tokenize!r}; "
                       f"choose from {', '.join(typing.get_args(BleuTokenizer))}")
    tokenize = None if options.tokenize == AUTO else options.tokenize  # None: sacreBLEU picks
    try:
        return BLEU(lowercase=options.lowercase, tokenize=tokenize, trg_lang=options.language or "")
    except (ImportError, RuntimeError) as exc:  # sacreBLEU's MeCab tokenizers, without MeCab
        name = tokenize or BLEU._TOKENIZER_MAP.get(options.language or "", BLEU.TOKENIZER_DEFAULT)
        if name not in INSTALL_HINTS:
            raise
        raise NmtError(f"BLEU tokenizer {name} needs extra packages: {install_hint(INSTALL_HINTS[name])} "
                       "(or choose another --tokenize)") from exc
    except OSError as exc:  # the spm/flores tokenizers download their sentencepiece model on first use
        raise NmtError(f"BLEU tokenizer {tokenize} could not fetch its sentencepiece model "
                       f"({exc.reason if hasattr(exc, 'reason') else exc}); choose another --tokenize") from exc


def _metric(name: str, options: MetricOptions):
    lowercase = options.lowercase
    if name == "bleu":
        return bleu_metric(options)
    if name == "chrf":
        return CHRF(lowercase=lowercase)
    if name == "ter":
        return TER(case_sensitive=not lowercase)
    raise NmtError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")


def score(hypotheses: Sequence[str], references: Sequence[Sequence[str]], metrics: Sequence[str] = ("bleu",),
          options: MetricOptions = MetricOptions()) -> list[MetricResult]:
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
        metric = _metric(name, options)
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


def language_of(path: str | Path) -> str | None:
    """The language code a file's name ends with (``test.ja``, ``test.zh.gz``, ``test.zh.txt``), if it looks like
    one."""
    name = Path(path).name.removesuffix(".gz").removesuffix(".txt")
    suffix = Path(name).suffix.lstrip(".")
    return suffix.lower() if re.fullmatch(r"[A-Za-z]{2,3}", suffix) else None


def score_files(system: str | Path, references: Sequence[str | Path], metrics: Sequence[str] = ("bleu",),
                options: MetricOptions = MetricOptions()) -> list[MetricResult]:
    """`nmt score`: read the system output and references, check their line counts, score.

    Without ``options.language`` the target language is read from the first reference's name."""
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
    if options.language is None and str(references[0]) != STDIN:
        options = dataclasses.replace(options, language=language_of(references[0]))
    return score(hypotheses, reference_streams, metrics, options)


def format_results(results: Sequence[MetricResult], as_json: bool = False) -> str:
    """sacrebleu's text lines (score with signature), or one JSON list."""
    if as_json:
        return json.dumps([result.to_dict() for result in results], ensure_ascii=False, indent=1)
    return "\n".join(result.formatted for result in results)
