"""``nmt generate``: translate a binarized split or raw text with a checkpoint.

Inputs are sorted by length and batched (``max_tokens`` counts source tokens times beam) to cut
padding; translations come back in input order, and do not depend on the batching (each
sentence's search is independent, and padding is masked). An empty input line (no tokens)
becomes an empty translation without running the model, so output lines stay aligned with
input lines. Raw text from a pipe or a terminal is translated as it arrives (see
streaming.py), each batch written and flushed before more is read. The model runs under
``torch.inference_mode`` with optional autocast (bf16/fp16), or on CPU with int8 dynamic
quantization of its linear layers, the output projection included (given a module of its own
for it); attention's matrix products stay fp32 then.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal, NamedTuple

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from torch import nn

from nmt.checkpoint import Vocabularies, load_checkpoint, model_from_checkpoint
from nmt.data.batching import batch_by_size, collate
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import EOS_ID, UNK_ID
from nmt.device import Precision, autocast, resolve_device, resolve_precision
from nmt.errors import NmtError
from nmt.files import atomic_write, read_lines, refuse_overwriting
from nmt.generation.alignment import word_attentions
from nmt.generation.ensemble import Ensemble, split_paths
from nmt.generation.output import Translation, write_translations
from nmt.generation.search import Hypothesis, SearchOptions, beam_search, model_positions
from nmt.generation.streaming import LineReader, is_stream
from nmt.generation.workers import map_in_workers
from nmt.models.attention_maps import layer_index
from nmt.log import logger, stderr_console
from nmt.options import check_values
from nmt.scoring import AUTO, LOWERCASE_HELP, TOKENIZE_HELP, BleuTokenizer, MetricOptions, MetricResult, score


@dataclass(frozen=True)
class BatchingOptions:
    """How sentences are grouped for the model; the output never depends on it."""

    max_tokens: int | None = field(default=8000, metadata={"help": "Source tokens x beam per batch.", "min": 1})
    batch_size: int | None = field(default=None, metadata={"help": "Sentences per batch at most.", "min": 1})
    workers: int = field(default=1, metadata={
        "help": "Batches decoded at the same time, each on its own thread, sharing the CPU threads (CTranslate2's "
                "inter_threads); each gets at least one, so more workers than threads share cores. Not with "
                "--sampling.", "min": 1})

    def __post_init__(self) -> None:
        check_values(self)
        if self.max_tokens is None and self.batch_size is None:
            raise NmtError("give --max-tokens or --batch-size")


@dataclass(frozen=True)
class GenerateOptions:
    """The options of ``nmt generate``: what to translate, where to write it, on what device, and the
    search and batching options composed in. Option names are the CLI's and the recipe's keys."""

    data: str | None = field(default=None, metadata={
        "help": "Data directory from `nmt preprocess` (or use --input).", "argument": True, "metavar": "[DATA_DIR]"})
    path: list[str] = field(default_factory=lambda: ["checkpoints/checkpoint_best.pt"], metadata={
        "help": "Checkpoint to translate with; several (a.pt:b.pt, or --path repeated) decode as an ensemble."})
    split: str = field(default="test", metadata={"help": "Split of DATA_DIR to translate."})
    input: str | None = field(default=None, metadata={
        "help": "Raw source text instead of DATA_DIR, one sentence a line ('-' = stdin, translated as lines arrive).",
        "flags": ["--input", "-i"]})
    output: str | None = field(default=None, metadata={
        "help": "Write here (atomically) instead of stdout.", "flags": ["--output", "-o"]})
    buffer_size: int | None = field(default=None, metadata={
        "help": "Streaming stdin: translate N lines at a time (waiting for N) instead of whatever has arrived.",
        "min": 1})
    format: Literal["plain", "fairseq"] = field(default="plain", metadata={
        "help": "plain: one translation per line; fairseq: S-/T-/H-/D-/P- lines."})
    print_scores: bool = field(default=False, metadata={
        "help": "Plain format: prefix each line with its score and a tab."})
    print_alignment: bool = field(default=False, metadata={
        "help": "Add each translation's word alignment (srcpos-tgtpos pairs from the cross-attention): a tab-separated "
                "column in plain format, A- lines in fairseq format."})
    alignment_layer: int | None = field(default=None, metadata={
        "help": "Decoder layer whose heads' mean attention gives the alignment, from 1; unset: the penultimate.",
        "min": 1})
    print_attention: str | None = field(default=None, metadata={
        "help": "Write each best translation's word-level soft attention to this JSON-lines file."})
    device: str = field(default="auto", metadata={"help": "auto (the GPU when there is one), cpu, cuda or cuda:N."})
    precision: Precision = field(default="auto", metadata={
        "help": "Autocast precision; auto: bf16 where the hardware runs it natively (bf16 GPUs, CPUs with "
                "avx512_bf16 or amx_bf16), else fp32."})
    quantize: Literal["none", "int8"] = field(default="none", metadata={
        "help": "CPU only: int8 dynamic quantization of every nn.Linear layer, the output projection included."})
    score_reference: bool = field(default=False, metadata={
        "help": "Print BLEU (on stderr) against the split's raw reference file, or its target side if that is gone."})
    tokenize: BleuTokenizer = field(default=AUTO, metadata={"help": f"With --score-reference: {TOKENIZE_HELP}"})
    lowercase: bool = field(default=False, metadata={"help": f"With --score-reference: {LOWERCASE_HELP}"})
    engine: Literal["nmt", "ctranslate2"] = field(default="nmt", metadata={
        "help": "nmt: its own decoder; ctranslate2: CTranslate2 (the ct2 extra of nmt) on --path, a directory "
                "from `nmt export ctranslate2` or a checkpoint (exported to a temporary directory). Needs "
                "--lenpen-style fairseq; outputs can differ: see nmt/generation/ctranslate2_engine.py."})
    search: SearchOptions = field(default_factory=SearchOptions, metadata={
        "help": "Search options.", "panel": "Search"})
    batching: BatchingOptions = field(default_factory=BatchingOptions, metadata={
        "help": "Batching options.", "panel": "Batching"})

    def __post_init__(self) -> None:
        check_values(self)
        if (self.data is None) == (self.input is None):
            raise NmtError("give either DATA_DIR (with --split) or --input FILE|-")
        inference_device(self.device, self.precision, self.quantize, self.engine)  # a bad combination fails here
        if self.alignment_layer is not None and not (self.print_alignment or self.print_attention):
            raise NmtError("--alignment-layer applies with --print-alignment or --print-attention")
        if self.engine == "ctranslate2" and (self.print_alignment or self.print_attention):
            raise NmtError("--print-alignment and --print-attention need --engine nmt (attention weights)")
        check_workers(self.search, self.batching)
        if self.print_scores and self.format != "plain":
            raise NmtError("--print-scores is for --format plain (fairseq's H- lines carry the scores)")
        if self.buffer_size is not None and (self.input != "-" or self.output is not None):
            raise NmtError("--buffer-size applies to translating stdin as it arrives (--input - and no --output)")
        inputs = {"--input": self.input, "--path": [item for path in self.path for item in split_paths(path)]}
        refuse_overwriting("--output", self.output, {**inputs, "--print-attention": self.print_attention})
        refuse_overwriting("--print-attention", self.print_attention, inputs)
        if self.score_reference and self.data is None:
            raise NmtError("--score-reference needs a binarized split (DATA_DIR --split); "
                           "for raw input use `nmt score --ref FILE` on the output")


@dataclass
class GenerateResult:
    translations: list[Translation]  # in input order
    scores: list[MetricResult]  # BLEU against the reference, with --score-reference
    seconds: float  # translation time, loading excluded
    output_tokens: int  # tokens of the best hypotheses, EOS included


def check_workers(search: SearchOptions, batching: BatchingOptions, device: torch.device | None = None) -> None:
    """Sampling draws from one random generator: batches on several threads would make the draws
    depend on the threads' timing. On a GPU one batch already fills the device, and the attention
    backend switch (attention.py) is process-wide, not per thread."""
    if batching.workers > 1 and search.sampling:
        raise NmtError("--workers > 1 cannot be used with --sampling: the draws would depend on the threads' timing")
    if batching.workers > 1 and device is not None and device.type != "cpu":
        raise NmtError(f"--workers > 1 is for CPU decoding; on {device.type} use larger batches (--max-tokens)")


def inference_device(device: str, precision: str, quantize: str, engine: str = "nmt") -> tuple[torch.device, str, str]:
    """Where and in which precision to decode, and why. int8 (dynamic quantization) runs on the CPU
    and computes in fp32, so ``auto`` resolves to cpu/fp32 for it and bf16/fp16 are refused.
    CTranslate2 resolves ``auto`` itself (its kernels, not torch's, decide what runs natively)."""
    if quantize == "int8":
        if device not in ("cpu", "auto"):
            raise NmtError("--quantize int8 is for CPU inference (dynamic quantization); use --precision on GPU")
        if precision not in ("auto", "fp32"):
            raise NmtError(f"--quantize int8 computes in fp32: give --precision fp32 or auto, not {precision}")
        return torch.device("cpu"), "fp32", "int8 layers compute in fp32"
    resolved = resolve_device(device)
    if engine == "ctranslate2":
        return resolved, precision, "CTranslate2 chooses its compute type"
    precision, reason = resolve_precision(precision, resolved)
    autocast(resolved, precision)  # an impossible precision fails before the model is loaded
    return resolved, precision, reason


def prepare_model(checkpoint_path: str | Path | list[str], device: torch.device, quantize: str = "none"
                  ) -> tuple[nn.Module, Vocabularies]:
    """The model of a checkpoint, or an Ensemble of several (``a.pt:b.pt``, or a list; they must share
    vocabularies)."""
    given = checkpoint_path if isinstance(checkpoint_path, list) else [checkpoint_path]
    paths = [path for item in given for path in split_paths(str(item))]
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


@dataclass
class Workload:
    """What both engines start from: the result list (empty sources already answered), the sources
    to search, their lengths, the token budget of a batch of sentences, and the progress bar's task."""
    results: list[list[Hypothesis]]
    todo: np.ndarray  # positions in ``sources`` of the sentences to search
    lengths: np.ndarray  # their lengths, EOS included
    max_tokens: int | None  # per batch of source tokens: --max-tokens shared by the beams
    task: int | None


def plan_workload(sources: list[np.ndarray], search: SearchOptions, batching: BatchingOptions,
                  progress: Progress | None) -> Workload:
    """Answer the empty sources at once and size the batches of the others."""
    results = [empty_hypotheses(search.nbest) if len(s) <= 1 else [] for s in sources]
    todo = np.asarray([i for i, s in enumerate(sources) if len(s) > 1], dtype=np.int64)
    lengths = np.fromiter((len(sources[i]) for i in todo), dtype=np.int64, count=len(todo))
    # A sentence's beams take about beam * (source length + some output) rows of work.
    max_tokens = None if batching.max_tokens is None else max(batching.max_tokens // search.beam,
                                                              int(lengths.max(initial=1)))
    task = progress.add_task("translating", total=len(sources), completed=len(sources) - len(todo)) \
        if progress else None
    return Workload(results, todo, lengths, max_tokens, task)


def translate_ids(model: nn.Module, sources: list[np.ndarray], search: SearchOptions | None = None,
                  batching: BatchingOptions | None = None, device: torch.device = torch.device("cpu"),
                  precision: str = "fp32", progress: Progress | None = None,
                  generator: torch.Generator | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[list[Hypothesis]]:
    """The ``nbest`` hypotheses for each source (token ids ending in EOS), in the order given.

    Sampling draws from ``generator``; without one, from a new one seeded with ``search.seed`` (so
    callers translating in several calls, such as a stream, pass theirs to draw on). ``should_stop``
    goes to every beam search (see there)."""
    search, batching = search or SearchOptions(), batching or BatchingOptions()
    check_lengths(model, sources)
    check_workers(search, batching, device)
    if search.sampling and generator is None:
        generator = sampling_generator(search, device)
    work = plan_workload(sources, search, batching, progress)

    def search_batch(indices: np.ndarray) -> list[list[Hypothesis]]:
        with torch.inference_mode(), autocast(device, precision):  # both are per thread
            batch = collate(indices, [sources[i] for i in indices]).to(device)
            return beam_search(model, batch.source, search, generator, should_stop)

    batches = [work.todo[positions]
               for positions in batch_by_size(work.lengths, None, work.max_tokens, batching.batch_size)]
    # Also entered here: with one worker the batches run in this thread, and autocast keeps its
    # low-precision copies of the weights only until its outermost context ends.
    with torch.inference_mode(), autocast(device, precision):
        place_batches(work.results, batches, map_in_workers(search_batch, batches, batching.workers), progress,
                      work.task)
    return work.results


def place_batches(results: list[list[Hypothesis]], batches: list[np.ndarray],
                  hypotheses: Iterable[list[list[Hypothesis]]], progress: Progress | None, task: int | None) -> None:
    """Put each batch's hypotheses at its sources' positions as the batches finish, advancing the
    progress bar by sentences and output tokens."""
    output_tokens = 0
    for indices, batch_hypotheses in zip(batches, hypotheses):
        for index, hyps in zip(indices.tolist(), batch_hypotheses):
            results[index] = hyps
        if progress:
            output_tokens += sum(len(results[i][0].tokens) for i in indices)
            progress.update(task, advance=len(indices), tokens=output_tokens)


def sampling_generator(search: SearchOptions, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(search.seed)


def check_lengths(model: nn.Module, sources: list[np.ndarray]) -> None:
    """A source longer than the model's positions is an error before any work, not a failure mid-batch."""
    limit = model_positions(model)
    longest = max(range(len(sources)), key=lambda i: len(sources[i]), default=None)
    if limit is not None and longest is not None and len(sources[longest]) > limit:
        raise NmtError(f"input line {longest + 1} has {len(sources[longest])} tokens (EOS included), over the "
                       f"model's max_positions {limit}")


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
        shown = " ".join(c if c.isprintable() else f"U+{ord(c):04X}" for c in characters[:10]) + \
            (" ..." if len(characters) > 10 else "")
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


def split_text_files(options: GenerateOptions) -> tuple[str | None, str | None]:
    """The raw source and target files `nmt preprocess` made the split from, as meta.json records
    them (they may be gone since); None where it has none."""
    entry = DataDir.open(options.data).meta["splits"].get(options.split, {})
    return entry.get("source_file"), entry.get("target_file")


def raw_references(options: GenerateOptions, count: int) -> list[str] | None:
    """The split's target text as given to `nmt preprocess`, if that file is still there, unchanged in length."""
    path = split_text_files(options)[1]
    if not path or not Path(path).is_file():
        return None
    lines = read_lines(path)
    return lines if len(lines) == count else None


def score_against_references(options: GenerateOptions, hypotheses: list[str], decoded: list[str], language: str
                             ) -> list[MetricResult]:
    """BLEU against the raw reference file when it can be found; else against the binarized target
    side as sentencepiece decodes it (normalized text, UNK shown as " ⁇ "), with a warning."""

    references = raw_references(options, len(hypotheses))
    if references is None:
        logger.warning("the raw reference file of split %r was not found: scoring against its binarized target "
                       "side (sentencepiece-normalized); for a reportable BLEU run `nmt score --ref FILE`",
                       options.split)
        references = decoded
    return score(hypotheses, [references], options=MetricOptions(options.tokenize, options.lowercase, language))


TranslateSources = Callable[[list[np.ndarray], Progress | None], list[list[Hypothesis]]]  # as translate_ids


class Engine(NamedTuple):
    """What translates: a function from source ids to hypotheses, and the vocabularies."""

    translate: TranslateSources
    vocabs: Vocabularies
    model: nn.Module | None  # nmt's model (for attention weights); None for CTranslate2


def load_engine(options: GenerateOptions, device: torch.device) -> Engine:
    """nmt's decoder (one model or an ensemble) or CTranslate2's, as --engine says."""
    if options.engine == "ctranslate2":
        from nmt.generation.ctranslate2_engine import load_ctranslate2

        return Engine(*load_ctranslate2(options, device), None)
    model, vocabs = prepare_model(options.path, device, options.quantize)
    generator = sampling_generator(options.search, device) if options.search.sampling else None  # one stream of draws
    return Engine(lambda sources, progress=None: translate_ids(model, sources, options.search, options.batching,
                                                               device, options.precision, progress, generator),
                  vocabs, model)


def translate_stream(engine: Engine, options: GenerateOptions, device: torch.device) -> list[Translation]:
    """Translate stdin as lines arrive, writing and flushing each batch before reading on."""
    reader = LineReader(name="stdin")
    translations: list[Translation] = []
    while lines := reader.next_batch(options.buffer_size):
        sources = encode_sources(engine.vocabs, lines)
        hypotheses = engine.translate(sources, None)
        batch = [Translation(len(translations) + i, line, hyps) for i, (line, hyps) in enumerate(zip(lines, hypotheses))]
        if options.print_alignment or options.print_attention:
            attach_attention(engine.model, engine.vocabs, sources, batch, options, device)
        write_translations(batch, engine.vocabs, None, options.format, options.print_scores)
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
    layer = layer_index(options.alignment_layer, len(model.decoder_layers), "--alignment-layer")
    pairs = [(t, h, source) for t, source in zip(translations, sources) for h in t.hypotheses]
    attentions = word_attentions(model, vocabs, [source for _, _, source in pairs], [h.tokens for _, h, _ in pairs],
                                 layer, device)
    for t in translations:
        t.attention = []
    for (t, _, _), attention in zip(pairs, attentions):
        t.attention.append(attention)


def write_attention(translations: list[Translation], path: str) -> None:
    with atomic_write(path) as handle:
        for t in translations:
            handle.write(json.dumps({"index": t.index, **t.attention[0].to_json()}, ensure_ascii=False) + "\n")


def generate(options: GenerateOptions, show_progress: bool = True) -> GenerateResult:
    """Translate, write the output (atomically to a file, or to stdout) and, with
    ``score_reference``, score the best hypotheses against the split's reference.

    Raw text from a pipe or terminal to stdout is translated as it arrives (``buffer_size``
    lines at a time, or what is waiting); files are read whole and batched by length."""
    if options.data is not None:
        raw = [path for path in split_text_files(options) if path]
        refuse_overwriting("--output", options.output, {"raw text of the split": raw})
        refuse_overwriting("--print-attention", options.print_attention, {"raw text of the split": raw})
    device, precision, reason = inference_device(options.device, options.precision, options.quantize, options.engine)
    options = dataclasses.replace(options, precision=precision)
    engine = load_engine(options, device)
    vocabs = engine.vocabs
    start = time.perf_counter()
    references = None
    if options.input == "-" and options.output is None and is_stream(sys.stdin):
        translations = translate_stream(engine, options, device)
    else:
        sources, source_texts, references = read_inputs(options, vocabs)
        start = time.perf_counter()
        with progress_bar(show_progress and stderr_console.is_terminal) as progress:
            hypotheses = engine.translate(sources, progress)
        translations = [Translation(i, source_texts[i], hyps, references[i] if references else None)
                        for i, hyps in enumerate(hypotheses)]
        if options.print_alignment or options.print_attention:
            attach_attention(engine.model, vocabs, sources, translations, options, device)
        write_translations(translations, vocabs, options.output, options.format, options.print_scores)
    seconds = time.perf_counter() - start
    if options.print_attention:
        write_attention(translations, options.print_attention)
    output_tokens = sum(len(t.hypotheses[0].tokens) for t in translations)
    logger.info("translated %d sentences in %.1f s (%.1f sentences/s, %.0f tokens/s); precision: %s (%s)",
                len(translations), seconds, len(translations) / max(seconds, 1e-9), output_tokens / max(seconds, 1e-9),
                precision, reason)
    scores = []
    if options.score_reference:
        scores = score_against_references(options, [t.best(vocabs) for t in translations], references,
                                          vocabs.target_lang)
    return GenerateResult(translations, scores, seconds, output_tokens)
