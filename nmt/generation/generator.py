"""``nmt generate``: translate a binarized split or raw text with a checkpoint.

Inputs are sorted by length and batched (``max_tokens`` counts source tokens times beam) to cut
padding; translations come back in input order, and do not depend on the batching (each
sentence's search is independent, and padding is masked). An empty input line (no tokens)
becomes an empty translation without running the model, so output lines stay aligned with
input lines. Raw text from a pipe or a terminal is translated as it arrives (see
streaming.py), each batch written and flushed before more is read. The model runs under ``torch.inference_mode`` with optional autocast (bf16/fp16),
or on CPU with int8 dynamic quantization of its linear layers, the output projection included
(given a module of its own for it); attention's matrix products stay fp32 then.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass, field
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
from nmt.data.vocabulary import EOS_ID, UNK_ID
from nmt.device import autocast, resolve_device
from nmt.errors import NmtError
from nmt.files import atomic_write, read_lines
from nmt.generation.alignment import word_attentions
from nmt.generation.ensemble import Ensemble, split_paths
from nmt.generation.output import Translation, write_translations
from nmt.generation.search import Hypothesis, SearchOptions, beam_search
from nmt.generation.streaming import LineReader, is_stream
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
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    quantize: Literal["none", "int8"] = "none"
    score_reference: bool = False
    print_alignment: bool = field(default=False, metadata={
        "help": "Add each translation's word alignment (srcpos-tgtpos pairs from the cross-attention): a tab-separated "
                "column in plain format, A- lines in fairseq format."})
    alignment_layer: int | None = field(default=None, metadata={
        "help": "Decoder layer whose heads' mean attention gives the alignment, from 1 (default: the penultimate).",
        "min": 1})
    print_attention: str | None = field(default=None, metadata={
        "help": "Write each best translation's word-level soft attention to this JSON-lines file."})
    progress: bool = True
    buffer_size: int | None = field(default=None, metadata={
        "help": "Streaming stdin: translate N lines at a time (waiting for N) instead of whatever has arrived.",
        "min": 1})

    def validate(self) -> None:
        if (self.data is None) == (self.input is None):
            raise NmtError("give either DATA_DIR (with --split) or --input FILE|-")
        self.validate_search()
        if self.quantize == "int8" and self.device != "cpu":
            raise NmtError("--quantize int8 is for CPU inference (dynamic quantization); use --precision on GPU")
        if self.buffer_size is not None and self.buffer_size < 1:
            raise NmtError(f"--buffer-size must be at least 1, got {self.buffer_size}")
        if self.alignment_layer is not None and not (self.print_alignment or self.print_attention):
            raise NmtError("--alignment-layer applies with --print-alignment or --print-attention")
        if self.score_reference and self.data is None:
            raise NmtError("--score-reference needs a binarized split (DATA_DIR --split); "
                           "for raw input use `nmt score --ref FILE` on the output")

    def validate_search(self) -> None:
        """The checks of the options a `Translator` call may change too (search and batching)."""
        if self.beam < 1:
            raise NmtError(f"--beam must be at least 1, got {self.beam}")
        if not 1 <= self.nbest <= self.beam:
            raise NmtError(f"--nbest must be between 1 and --beam ({self.beam}), got {self.nbest}")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise NmtError("--max-len-a and --max-len-b must not be negative")
        if self.min_len < 0 or self.no_repeat_ngram_size < 0:
            raise NmtError("--min-len and --no-repeat-ngram-size must not be negative")
        if self.lenpen_style not in ("gnmt", "fairseq"):
            raise NmtError(f"--lenpen-style must be gnmt or fairseq, got {self.lenpen_style!r}")
        if self.temperature <= 0:
            raise NmtError(f"--temperature must be positive, got {self.temperature}")
        if self.topk < 0 or not 0.0 <= self.topp <= 1.0:
            raise NmtError("--topk must be >= 0 and --topp in [0, 1]")
        if (self.topk or self.topp) and not self.sampling:
            raise NmtError("--topk/--topp only apply with --sampling")
        if self.max_tokens is None and self.batch_size is None:
            raise NmtError("give --max-tokens or --batch-size")
        if (self.max_tokens is not None and self.max_tokens < 1) or (self.batch_size is not None
                                                                      and self.batch_size < 1):
            raise NmtError("--max-tokens and --batch-size must be at least 1")


@dataclass
class GenerateResult:
    translations: list[Translation]  # in input order
    scores: list[MetricResult]  # BLEU against the reference, with --score-reference
    seconds: float  # translation time, loading excluded
    output_tokens: int  # tokens of the best hypotheses, EOS included


def prepare_model(checkpoint_path: str | Path, device: torch.device, quantize: str = "none"
                  ) -> tuple[nn.Module, Vocabularies]:
    """The model of a checkpoint, or an Ensemble of those of ``a.pt:b.pt`` (which must share vocabularies)."""
    paths = split_paths(str(checkpoint_path))
    models, vocabs = [], None
    for path in paths:
        model, its_vocabs = model_from_checkpoint(load_checkpoint(path))
        if vocabs is not None and its_vocabs != vocabs:
            raise NmtError(f"cannot ensemble {path} with {paths[0]}: their vocabularies or languages differ")
        models.append(inference_model(model, quantize))
        vocabs = its_vocabs
    return (models[0] if len(models) == 1 else Ensemble(models)).to(device), vocabs


def inference_model(model: nn.Module, quantize: str) -> nn.Module:
    model.eval()
    if quantize == "int8":
        model.separate_output_layer()  # the largest product of every step; int8 only sees modules
        with warnings.catch_warnings():  # torch.ao's eager quantization warns it will move to torchao
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    return model


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


def encode_sources(vocabs: Vocabularies, lines: list[str]) -> list[np.ndarray]:
    """Source token ids ending in EOS, one array per line; unknown characters are reported, not hidden."""
    ids = vocabs.source.encode_batch(lines)
    warn_unknown(vocabs, lines, ids)
    return [np.asarray(sentence + [EOS_ID], dtype=np.int64) for sentence in ids]


def warn_unknown(vocabs: Vocabularies, lines: list[str], ids: list[list[int]]) -> int:
    """One warning line when the source vocabulary cannot represent some input (a sentencepiece model
    without byte fallback meeting unseen characters): the model reads them as <unk> and they vanish."""
    unknown = sum(sentence.count(UNK_ID) for sentence in ids)
    if unknown:
        affected = [line for line, sentence in zip(lines, ids) if UNK_ID in sentence]
        characters = sorted({c for line in affected for c in line if UNK_ID in vocabs.source.encode(c)})
        shown = " ".join(characters[:10]) + (" ..." if len(characters) > 10 else "")
        logger.warning("%d input token(s) in %d sentence(s) were unknown to the %s vocabulary and read as <unk> "
                       "(characters it cannot represent: %s)", unknown, len(affected), vocabs.source_lang, shown)
    return unknown


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
    return encode_sources(vocabs, lines), lines, None


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


def translate_stream(model: nn.Module, vocabs: Vocabularies, options: GenerateOptions, device: torch.device
                     ) -> list[Translation]:
    """Translate stdin as lines arrive, writing and flushing each batch before reading on."""
    reader = LineReader(name="stdin")
    translations: list[Translation] = []
    while lines := reader.next_batch(options.buffer_size):
        sources = encode_sources(vocabs, lines)
        hypotheses = translate_ids(model, sources, options, device)
        batch = [Translation(len(translations) + i, line, hyps) for i, (line, hyps) in enumerate(zip(lines, hypotheses))]
        if options.print_alignment or options.print_attention:
            attach_attention(model, vocabs, sources, batch, options, device)
        write_translations(batch, vocabs, None, options.format, options.print_scores)
        translations += batch
    if not translations:
        raise NmtError("stdin is empty: nothing to translate")
    return translations


def attach_attention(model: nn.Module, vocabs: Vocabularies, sources: list[np.ndarray],
                     translations: list[Translation], options: GenerateOptions, device: torch.device) -> None:
    """Re-score the chosen hypotheses once with attention weights (search never pays for them).

    ``sources`` are the translations' source ids, in the same order. An ensemble aligns with its first model.
    """
    model = model.models[0] if isinstance(model, Ensemble) else model
    layers = len(model.decoder_layers)
    layer = options.alignment_layer if options.alignment_layer is not None else max(layers - 1, 1)
    if layer > layers:
        raise NmtError(f"--alignment-layer must be between 1 and {layers} for this model, got {layer}")
    pairs = [(t, h, source) for t, source in zip(translations, sources) for h in t.hypotheses]
    attentions = word_attentions(model, vocabs, [source for _, _, source in pairs], [h.tokens for _, h, _ in pairs],
                                 layer - 1, device)
    for t in translations:
        t.attention = []
    for (t, _, _), attention in zip(pairs, attentions):
        t.attention.append(attention)


def write_attention(translations: list[Translation], path: str) -> None:
    with atomic_write(path) as handle:
        for t in translations:
            handle.write(json.dumps({"index": t.index, **t.attention[0].to_json()}, ensure_ascii=False) + "\n")


def generate(options: GenerateOptions) -> GenerateResult:
    """Translate, write the output (atomically to a file, or to stdout) and, with
    ``score_reference``, score the best hypotheses against the split's reference.

    Raw text from a pipe or terminal to stdout is translated as it arrives (``buffer_size``
    lines at a time, or what is waiting); files are read whole and batched by length."""
    options.validate()
    device = resolve_device(options.device)
    autocast(device, options.precision)  # an impossible precision fails before the model is loaded
    model, vocabs = prepare_model(options.path, device, options.quantize)
    start = time.perf_counter()
    references = None
    if options.input == "-" and options.output is None and is_stream(sys.stdin):
        translations = translate_stream(model, vocabs, options, device)
    else:
        sources, source_texts, references = read_inputs(options, vocabs)
        start = time.perf_counter()
        with progress_bar(options.progress and stderr_console.is_terminal) as progress:
            hypotheses = translate_ids(model, sources, options, device, progress)
        translations = [Translation(i, source_texts[i], hyps, references[i] if references else None)
                        for i, hyps in enumerate(hypotheses)]
        if options.print_alignment or options.print_attention:
            attach_attention(model, vocabs, sources, translations, options, device)
        write_translations(translations, vocabs, options.output, options.format, options.print_scores)
    seconds = time.perf_counter() - start
    if options.print_attention:
        write_attention(translations, options.print_attention)
    output_tokens = sum(len(t.hypotheses[0].tokens) for t in translations)
    logger.info("translated %d sentences in %.1f s (%.1f sentences/s, %.0f tokens/s)", len(translations), seconds,
                len(translations) / max(seconds, 1e-9), output_tokens / max(seconds, 1e-9))
    scores = []
    if options.score_reference:
        scores = score_against_references(options, [t.best(vocabs) for t in translations], references)
    return GenerateResult(translations, scores, seconds, output_tokens)
