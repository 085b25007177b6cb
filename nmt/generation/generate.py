"""``nmt generate``: translate a binarized split or raw text with a checkpoint, write the output
and optionally score it.

Files are read whole and batched by length (nmt/generation/inference.py); raw text from a pipe or
a terminal is translated as it arrives (streaming.py), each batch written and flushed before more
is read. Output lines stay aligned with input lines, and the output file is written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from torch import nn

import nmt.huge_pages as huge_pages
from nmt.checkpoint.format import Vocabularies
from nmt.checkpoint.names import split_paths
from nmt.data.dataset import DataDir
from nmt.device import inference_device, using_threads
from nmt.errors import NmtError
from nmt.files import atomic_write, read_lines, refuse_overwriting, require_files
from nmt.generation.alignment import word_attentions
from nmt.generation.control_input import lines_with_controls, read_bans, warn_of_tabs
from nmt.generation.ctranslate2_engine import load_ctranslate2
from nmt.generation.decoding_settings import decoding_settings
from nmt.generation.ensemble import Ensemble
from nmt.generation.inference import (
    Controls,
    TranslateSources,
    TranslationRequest,
    encode_sources,
    prepare_model,
    sampling_generator,
    translate_ids,
    uses_shortlist,
)
from nmt.generation.options import GenerateOptions, SearchOptions
from nmt.generation.output import Translation, write_translations
from nmt.generation.streaming import LineReader, is_stream
from nmt.generation.workers import KeptWorkers
from nmt.log import logger, stderr_console
from nmt.models.attention_maps import layer_index
from nmt.scoring import MetricOptions, MetricResult, score


@dataclass
class GenerateResult:
    translations: list[Translation]  # in input order
    scores: list[MetricResult]  # BLEU against the reference, with --score-reference
    seconds: float  # translation time, loading excluded
    output_tokens: int  # tokens of the best hypotheses, EOS included


class TokenRateColumn(ProgressColumn):
    def render(self, task) -> Text:
        tokens = task.fields.get("tokens", 0)
        return Text(f"{tokens / task.elapsed:,.0f} tokens/s" if task.elapsed else "")


def progress_bar(show: bool) -> Progress:
    """Sentences done and output tokens/s on stderr; never on stdout, where translations go."""
    return Progress(TextColumn("translating"), BarColumn(), MofNCompleteColumn(), TextColumn("sentences"),
                    TokenRateColumn(), TimeElapsedColumn(), console=stderr_console, transient=True,
                    disable=not show)


def read_inputs(options: GenerateOptions, vocabs: Vocabularies, bans: list[list[int]]
                ) -> tuple[list[np.ndarray], list[str], list[str] | None, Controls | None]:
    """Source token ids, source text, (for a binarized split) reference text, and the controls."""
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
        texts = [vocabs.source.decode(s) for s in sources]
        _, controls = lines_with_controls(vocabs.target, texts, False, False, read_prefixes(options, len(texts)), bans)
        return sources, texts, references, controls
    lines = read_lines(options.input)  # empty in, empty out (a sharded pipeline has empty shards)
    warn_of_tabs(lines, options.prefix_column or options.constraints)
    texts, controls = lines_with_controls(vocabs.target, lines, options.prefix_column, options.constraints,
                                          read_prefixes(options, len(lines)), bans)
    return encode_sources(vocabs, texts), texts, None, controls


def read_prefixes(options: GenerateOptions, count: int) -> list[str] | None:
    """The lines of --prefix FILE, one for each of the ``count`` input lines."""
    if options.prefix is None:
        return None
    prefixes = read_lines(options.prefix)
    if len(prefixes) != count:
        raise NmtError(f"--prefix {options.prefix} has {len(prefixes)} lines but the input has {count}: one prefix "
                       "(or an empty line) per input line")
    return prefixes


def split_text_files(options: GenerateOptions) -> tuple[str | None, str | None]:
    """The raw source and target files `nmt preprocess` made the split from, as meta.json records
    them (they may be gone since); None where it has none."""
    entry = DataDir.open(options.data).meta.splits.get(options.split)
    return (entry.source_file, entry.target_file) if entry else (None, None)


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




class Engine(NamedTuple):
    """What translates: a function from source ids to hypotheses, and the vocabularies."""

    translate: TranslateSources
    vocabs: Vocabularies
    model: nn.Module | None  # nmt's model (for attention weights); None for CTranslate2
    kept_workers: KeptWorkers | None = None  # nmt's forked decoding workers, kept for all of stdin's batches

    def close(self) -> None:
        if self.kept_workers is not None:
            self.kept_workers.close()


def refuse_exported_models(paths: list[str]) -> None:
    """A CTranslate2 model directory (from `nmt export ctranslate2`) given to nmt's own decoder."""
    for path in (item for given in paths for item in split_paths(given)):
        if (Path(path) / "model.bin").is_file():
            raise NmtError(f"{path} is a CTranslate2 model directory: decode it with --engine ctranslate2")


def load_engine(options: GenerateOptions, device: torch.device) -> Engine:
    """nmt's decoder (one model or an ensemble) or CTranslate2's, as --engine says."""
    if options.engine == "ctranslate2":
        translate, vocabs = load_ctranslate2(options, device)
        log_shortlist(options.search, vocabs, device, "each batch scores the candidates of all its sentences "
                      "(CTranslate2's vocabulary map)")
        return Engine(translate, vocabs, None)
    model, vocabs = prepare_model(options.path, device, options.compute.quantize, options.compute.backend)
    log_shortlist(options.search, vocabs, device, "each sentence scores its own candidates")
    kept_workers = KeptWorkers()
    request = TranslationRequest(options.search, options.batching, device, options.compute.precision,
                                 shortlist=vocabs.shortlist, fork_workers=True,  # nmt generate's own process
                                 kept_workers=kept_workers,
                                 generator=sampling_generator(options.search, device) if options.search.sampling
                                 else None)  # one stream of draws for all calls
    return Engine(lambda sources, progress=None, controls=None, first_line=1: translate_ids(
        model, sources, dataclasses.replace(request, controls=controls, first_line=first_line), progress),
        vocabs, model, kept_workers)


def backend_note(engine: object) -> str:
    """For generate's last log line: what nmt's own decoder computed with (nmt/backends)."""
    backend = getattr(getattr(engine, "model", None), "backend", None)
    return f", decoding backend: {backend.describe()}" if backend is not None else ""


def log_shortlist(search: SearchOptions, vocabs: Vocabularies, device: torch.device, how: str) -> None:
    """Say that a shortlist is used (``how`` the engine uses it), and how to do without; or why the
    checkpoint's is not used here."""
    if not uses_shortlist(search, vocabs.shortlist, "cpu"):
        return
    if device.type != "cpu":
        logger.info("vocabulary shortlist: not on %s, where scoring all %d pieces costs less than choosing candidates",
                    device.type, len(vocabs.target))
    else:
        logger.info("vocabulary shortlist: %s (%d per source piece, %d frequent; --shortlist none scores all %d "
                    "pieces)", how, vocabs.shortlist.translations.shape[1],
                    len(vocabs.shortlist.frequent), len(vocabs.target))


def translate_stream(engine: Engine, options: GenerateOptions, device: torch.device, bans: list[list[int]]
                     ) -> list[Translation]:
    """Translate stdin as lines arrive, writing and flushing each batch before reading on."""
    reader = LineReader(name="stdin")
    translations: list[Translation] = []
    warned = False
    while lines := reader.next_batch(options.buffer_size):
        first_line = len(translations) + 1
        warned = warned or warn_of_tabs(lines, options.prefix_column or options.constraints, first_line)
        texts, controls = lines_with_controls(engine.vocabs.target, lines, options.prefix_column, options.constraints,
                                              None, bans, first_line)
        sources = encode_sources(engine.vocabs, texts)
        hypotheses = engine.translate(sources, None, controls, first_line)
        batch = [Translation(len(translations) + i, text, hyps)
                 for i, (text, hyps) in enumerate(zip(texts, hypotheses))]
        if options.print_alignment or options.print_attention:
            attach_attention(engine.model, engine.vocabs, sources, batch, options, device)
        write_translations(batch, engine.vocabs, None, options.format, options.print_scores)
        translations += batch
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
    with using_threads(options.compute.threads):  # --workers share them (nmt/generation/workers.py)
        return translate_and_write(options, show_progress)


def translate_and_write(options: GenerateOptions, show_progress: bool) -> GenerateResult:
    require_files({"--input": None if options.data is not None else options.input, "--prefix": options.prefix,
                   "--ban": options.ban})
    if options.data is not None:
        raw = [path for path in split_text_files(options) if path]
        refuse_overwriting("--output", options.output, {"raw text of the split": raw})
        refuse_overwriting("--print-attention", options.print_attention, {"raw text of the split": raw})
    decoding = ""
    if options.engine == "nmt":  # CTranslate2 keeps its own rule and compute type (load_ctranslate2)
        refuse_exported_models(options.path)
        settings = decoding_settings(options.compute, options.search, options.path)
        options = dataclasses.replace(options, compute=dataclasses.replace(options.compute, quantize=settings.quantize),
                                      search=dataclasses.replace(options.search, stop=settings.stop))
        decoding = f"; {settings.describe()}"
    device, precision, reason = inference_device(options.compute, options.engine)
    options = dataclasses.replace(options, compute=dataclasses.replace(options.compute, precision=precision))
    streaming = options.input == "-" and options.output is None and is_stream(sys.stdin)
    if streaming and options.prefix is not None:
        raise NmtError("--prefix FILE cannot follow stdin as it arrives: give each prefix on its input line "
                       "(--prefix-column)")
    engine = load_engine(options, device)
    vocabs = engine.vocabs
    bans = read_bans(vocabs.target, options.ban) if options.ban else []
    start = time.perf_counter()
    references = None
    try:
        if streaming:
            translations = translate_stream(engine, options, device, bans)
        else:
            sources, source_texts, references, controls = read_inputs(options, vocabs, bans)
            start = time.perf_counter()
            with progress_bar(show_progress and stderr_console.is_terminal) as progress:
                hypotheses = engine.translate(sources, progress, controls, 1)
            translations = [Translation(i, source_texts[i], hyps, references[i] if references else None)
                            for i, hyps in enumerate(hypotheses)]
            if options.print_alignment or options.print_attention:
                attach_attention(engine.model, vocabs, sources, translations, options, device)
            write_translations(translations, vocabs, options.output, options.format, options.print_scores)
    finally:  # the decoding workers end with the translating, not with the process
        engine.close()
    seconds = time.perf_counter() - start
    if options.print_attention:
        write_attention(translations, options.print_attention)
    output_tokens = sum(len(t.hypotheses[0].tokens) for t in translations)
    logger.info("translated %d sentence%s in %.1f s (%.1f sentences/s, %.0f tokens/s, %s%s); precision: %s (%s)%s",
                len(translations), "" if len(translations) == 1 else "s", seconds,
                len(translations) / max(seconds, 1e-9), output_tokens / max(seconds, 1e-9), huge_pages.describe(),
                backend_note(engine), precision, reason, decoding)
    scores = []
    if options.score_reference:
        scores = score_against_references(options, [t.best(vocabs) for t in translations], references,
                                          vocabs.target_lang)
    return GenerateResult(translations, scores, seconds, output_tokens)

