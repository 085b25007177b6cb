"""``nmt generate``: translate a binarized split or raw text with a checkpoint.

Inputs are sorted by length and batched (``max_tokens`` counts source tokens times beam) to cut
padding; translations come back in input order, and do not depend on the batching (each
sentence's search is independent, and padding is masked). An empty input line (no tokens)
becomes an empty translation without running the model, so output lines stay aligned with
input lines. The model runs under ``torch.inference_mode`` with optional autocast (bf16/fp16),
or on CPU with int8 dynamic quantization of its linear layers, the output projection included
(given a module of its own for it); attention's matrix products stay fp32 then.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from torch import nn

from nmt.checkpoint import Vocabularies, load_checkpoint, model_from_checkpoint
from nmt.data.batching import batch_by_size, collate
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import EOS_ID
from nmt.device import Precision, autocast, resolve_device, resolve_precision
from nmt.errors import NmtError
from nmt.files import read_lines
from nmt.generation.output import Translation, write_translations
from nmt.generation.search import Hypothesis, SearchOptions, beam_search
from nmt.log import logger, stderr_console

if TYPE_CHECKING:
    from nmt.scoring import MetricResult


@dataclass(frozen=True)
class GenerateOptions(SearchOptions):
    """The options of ``nmt generate``: the search's plus input, output and device.

    Field names are the CLI option names (and recipe keys).
    """

    path: str = "checkpoints/checkpoint_best.pt"
    data: str | None = None  # data directory from `nmt preprocess` (with `split`)...
    split: str = "test"
    input: str | None = None  # ...or raw source text, one sentence a line ("-": stdin)
    output: str | None = None  # default: stdout
    seed: int = 1  # for --sampling
    format: Literal["plain", "fairseq"] = "plain"
    print_scores: bool = False
    max_tokens: int | None = 8000
    batch_size: int | None = None
    device: str = "cpu"
    precision: Precision = "auto"
    quantize: Literal["none", "int8"] = "none"
    score_reference: bool = False
    progress: bool = True

    def validate(self) -> None:
        if (self.data is None) == (self.input is None):
            raise NmtError("give either DATA_DIR (with --split) or --input FILE|-")
        if self.beam < 1:
            raise NmtError(f"--beam must be at least 1, got {self.beam}")
        if not 1 <= self.nbest <= self.beam:
            raise NmtError(f"--nbest must be between 1 and --beam ({self.beam}), got {self.nbest}")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise NmtError("--max-len-a and --max-len-b must not be negative")
        if self.min_len < 0 or self.no_repeat_ngram_size < 0:
            raise NmtError("--min-len and --no-repeat-ngram-size must not be negative")
        if self.temperature <= 0:
            raise NmtError(f"--temperature must be positive, got {self.temperature}")
        if self.topk < 0 or not 0.0 <= self.topp <= 1.0:
            raise NmtError("--topk must be >= 0 and --topp in [0, 1]")
        if (self.topk or self.topp) and not self.sampling:
            raise NmtError("--topk/--topp only apply with --sampling")
        if self.max_tokens is None and self.batch_size is None:
            raise NmtError("give --max-tokens or --batch-size")
        if self.quantize == "int8" and self.device != "cpu":
            raise NmtError("--quantize int8 is for CPU inference (dynamic quantization); use --precision on GPU")
        if self.score_reference and self.data is None:
            raise NmtError("--score-reference needs a binarized split (DATA_DIR --split); "
                           "for raw input use `nmt score --ref FILE` on the output")


@dataclass
class GenerateResult:
    translations: list[Translation]  # in input order
    scores: list[MetricResult]  # BLEU against the reference, with --score-reference
    seconds: float  # translation time, loading excluded
    output_tokens: int  # tokens of the best hypotheses, EOS included


def prepare_model(checkpoint_path: str | Path, device: torch.device, quantize: str = "none"
                  ) -> tuple[nn.Module, Vocabularies]:
    model, vocabs = model_from_checkpoint(load_checkpoint(checkpoint_path))
    model.eval()
    if quantize == "int8":
        model.separate_output_layer()  # the largest product of every step; int8 only sees modules
        with warnings.catch_warnings():  # torch.ao's eager quantization warns it will move to torchao
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    return model.to(device), vocabs


class TokenRateColumn(ProgressColumn):
    def render(self, task) -> Text:
        tokens = task.fields.get("tokens", 0)
        return Text(f"{tokens / task.elapsed:,.0f} tokens/s" if task.elapsed else "")


def progress_bar(show: bool) -> Progress:
    """Sentences done and output tokens/s on stderr; never on stdout, where translations go."""
    return Progress(TextColumn("translating"), BarColumn(), MofNCompleteColumn(), TextColumn("sentences"),
                    TokenRateColumn(), TimeElapsedColumn(), console=stderr_console, transient=True,
                    disable=not show)


def empty_hypotheses(nbest: int) -> list[Hypothesis]:
    return [Hypothesis(tokens=[EOS_ID], score=0.0, positional_scores=[0.0]) for _ in range(nbest)]


def translate_ids(model: nn.Module, sources: list[np.ndarray], options: GenerateOptions,
                  device: torch.device = torch.device("cpu"), progress: Progress | None = None
                  ) -> list[list[Hypothesis]]:
    """The ``nbest`` hypotheses for each source (token ids ending in EOS), in the order given."""
    results = [empty_hypotheses(options.nbest) if len(s) <= 1 else [] for s in sources]
    todo = np.asarray([i for i, s in enumerate(sources) if len(s) > 1], dtype=np.int64)
    lengths = np.fromiter((len(sources[i]) for i in todo), dtype=np.int64, count=len(todo))
    # A sentence's beams take about beam * (source length + some output) rows of work.
    max_tokens = None if options.max_tokens is None else max(options.max_tokens // options.beam,
                                                             int(lengths.max(initial=1)))
    generator = torch.Generator(device=device).manual_seed(options.seed) if options.sampling else None
    skipped = len(sources) - len(todo)
    task = progress.add_task("translating", total=len(sources), completed=skipped) if progress else None
    output_tokens = 0
    with torch.inference_mode(), autocast(device, options.precision):
        for batch_positions in batch_by_size(lengths, None, max_tokens, options.batch_size):
            indices = todo[batch_positions]
            batch = collate(indices, [sources[i] for i in indices]).to(device)
            for index, hyps in zip(indices.tolist(), beam_search(model, batch.source, options, generator)):
                results[index] = hyps
            if progress:
                output_tokens += sum(len(results[i][0].tokens) for i in indices)
                progress.update(task, advance=len(indices), tokens=output_tokens)
    return results


def translate(model: nn.Module, vocabs: Vocabularies, sentences: list[str], options: GenerateOptions | None = None,
              device: torch.device = torch.device("cpu")) -> list[str]:
    """The best translation of each raw sentence, detokenized: the library's one-call entry point."""
    ids = vocabs.source.encode_batch(sentences)
    sources = [np.asarray(s + [EOS_ID], dtype=np.int64) for s in ids]
    return [vocabs.target.decode(hyps[0].tokens)
            for hyps in translate_ids(model, sources, options or GenerateOptions(), device)]


def read_inputs(options: GenerateOptions, vocabs: Vocabularies) -> tuple[list[np.ndarray], list[str], list[str] | None]:
    """Source token ids, source text and (for a binarized split) reference text."""
    if options.data is not None:
        datadir = DataDir.open(options.data)
        if (datadir.source_lang, datadir.target_lang) != (vocabs.source_lang, vocabs.target_lang):
            raise NmtError(f"{options.data} is {datadir.source_lang}-{datadir.target_lang} but the checkpoint "
                           f"translates {vocabs.source_lang}-{vocabs.target_lang}")
        if datadir.vocabulary(datadir.source_lang) != vocabs.source:
            raise NmtError(f"{options.data} was made with another sentencepiece model than the checkpoint's")
        split = datadir.split(options.split)
        sources = [split.source[i] for i in range(len(split))]
        references = [vocabs.target.decode(split.target[i]) for i in range(len(split))]
        return sources, [vocabs.source.decode(s) for s in sources], references
    lines = read_lines(options.input)
    if not lines:
        raise NmtError(f"{'stdin' if options.input == '-' else options.input} is empty: nothing to translate")
    ids = vocabs.source.encode_batch(lines)
    return [np.asarray(s + [EOS_ID], dtype=np.int64) for s in ids], lines, None


def raw_references(options: GenerateOptions, count: int) -> list[str] | None:
    """The split's target text as given to `nmt preprocess`, if that file is still there, unchanged in length."""
    entry = DataDir.open(options.data).meta["splits"][options.split]
    path = entry.get("target_file")
    if not path or not Path(path).is_file():
        return None
    lines = read_lines(path)
    return lines if len(lines) == count else None


def score_against_references(options: GenerateOptions, hypotheses: list[str], decoded: list[str]
                             ) -> list[MetricResult]:
    """BLEU against the raw reference file when it can be found; else against the binarized target
    side as sentencepiece decodes it (normalized text, UNK shown as " ⁇ "), with a warning."""
    from nmt.scoring import score

    references = raw_references(options, len(hypotheses))
    if references is None:
        logger.warning("the raw reference file of split %r was not found: scoring against its binarized target "
                       "side (sentencepiece-normalized); for a reportable BLEU run `nmt score --ref FILE`",
                       options.split)
        references = decoded
    return score(hypotheses, [references])


def generate(options: GenerateOptions) -> GenerateResult:
    """Translate, write the output (atomically to a file, or to stdout) and, with
    ``score_reference``, score the best hypotheses against the split's reference."""
    options.validate()
    device = resolve_device(options.device)
    precision, reason = resolve_precision(options.precision, device)
    options = dataclasses.replace(options, precision=precision)
    autocast(device, precision)  # an impossible precision fails before the model is loaded
    model, vocabs = prepare_model(options.path, device, options.quantize)
    sources, source_texts, references = read_inputs(options, vocabs)
    logger.info("precision: %s (%s)", precision, reason)
    start = time.perf_counter()
    with progress_bar(options.progress and stderr_console.is_terminal) as progress:
        hypotheses = translate_ids(model, sources, options, device, progress)
    seconds = time.perf_counter() - start
    translations = [Translation(i, source_texts[i], hyps, references[i] if references else None)
                    for i, hyps in enumerate(hypotheses)]
    write_translations(translations, vocabs, options.output, options.format, options.print_scores)
    output_tokens = sum(len(t.hypotheses[0].tokens) for t in translations)
    logger.info("translated %d sentences in %.1f s (%.1f sentences/s, %.0f tokens/s)", len(translations), seconds,
                len(translations) / max(seconds, 1e-9), output_tokens / max(seconds, 1e-9))
    scores = []
    if options.score_reference:
        scores = score_against_references(options, [t.best(vocabs) for t in translations], references)
    return GenerateResult(translations, scores, seconds, output_tokens)
