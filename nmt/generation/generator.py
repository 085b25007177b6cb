"""``nmt generate``: translate a binarized split or raw text with a checkpoint.

Inputs are sorted by length and batched to cut padding; translations come back in input order.
The model runs under ``torch.inference_mode`` with optional autocast (bf16/fp16) or, on CPU,
int8 dynamic quantization of its linear layers.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from nmt.checkpoint import Vocabularies, load_checkpoint, model_from_checkpoint
from nmt.data.batching import batch_by_size, collate
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import EOS_ID
from nmt.device import autocast, resolve_device
from nmt.errors import NmtError
from nmt.files import atomic_write, read_lines
from nmt.generation.search import Hypothesis, SearchOptions, beam_search
from nmt.log import logger, stderr_console


@dataclass
class GenerateOptions:
    """The options of ``nmt generate``; field names are the CLI option names (and recipe keys)."""

    path: str = "checkpoints/checkpoint_best.pt"
    data: str | None = None  # data directory from `nmt preprocess` (with `split`)...
    split: str = "test"
    input: str | None = None  # ...or raw source text, one sentence a line ("-": stdin)
    output: str | None = None  # default: stdout
    beam: int = 4
    lenpen: float = 0.6
    lenpen_style: Literal["gnmt", "fairseq"] = "gnmt"
    max_len_a: float = 1.0
    max_len_b: int = 50
    min_len: int = 1
    no_repeat_ngram_size: int = 0
    nbest: int = 1
    sampling: bool = False
    temperature: float = 1.0
    topk: int = 0
    topp: float = 0.0
    seed: int = 1
    format: Literal["plain", "fairseq"] = "plain"
    print_scores: bool = False
    max_tokens: int | None = 8000
    batch_size: int | None = None
    device: str = "cpu"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
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

    def search_options(self) -> SearchOptions:
        names = {f.name for f in dataclasses.fields(SearchOptions)}
        return SearchOptions(**{name: getattr(self, name) for name in names})


@dataclass
class Translation:
    index: int  # line number in the input, from 0
    source: str
    hypotheses: list[Hypothesis]
    reference: str | None = None


def prepare_model(checkpoint_path: str | Path, device: torch.device, quantize: str) -> tuple[nn.Module, Vocabularies]:
    model, vocabs = model_from_checkpoint(load_checkpoint(checkpoint_path))
    model.eval()
    if quantize == "int8":
        with warnings.catch_warnings():  # torch.ao's eager quantization warns it will move to torchao
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    return model.to(device), vocabs


def translate(model: nn.Module, sources: list[np.ndarray], options: GenerateOptions,
              device: torch.device = torch.device("cpu"), progress: Progress | None = None) -> list[list[Hypothesis]]:
    """Hypotheses for each source (token ids ending in EOS), in the order given."""
    search = options.search_options()
    lengths = np.fromiter((len(s) for s in sources), dtype=np.int64, count=len(sources))
    # A sentence's beams take about beam * (source length + some output) rows of work.
    max_tokens = None if options.max_tokens is None else max(options.max_tokens // search.beam, int(lengths.max(initial=1)))
    batches = batch_by_size(lengths, None, max_tokens, options.batch_size)
    results: list[list[Hypothesis]] = [[] for _ in sources]
    generator = torch.Generator(device=device).manual_seed(options.seed) if options.sampling else None
    task = progress.add_task("translating", total=len(sources)) if progress else None
    with torch.inference_mode(), autocast(device, options.precision):
        for indices in batches:
            batch = collate(indices, [sources[i] for i in indices]).to(device)
            for index, hyps in zip(indices.tolist(), beam_search(model, batch.source, search, generator)):
                results[index] = hyps
            if progress:
                progress.advance(task, len(indices))
    return results


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


def format_translation(t: Translation, vocabs: Vocabularies, options: GenerateOptions) -> list[str]:
    if options.format == "fairseq":
        lines = [f"S-{t.index}\t{t.source}"]
        if t.reference is not None:
            lines.append(f"T-{t.index}\t{t.reference}")
        for h in t.hypotheses:
            pieces = " ".join(vocabs.target.piece(i) for i in h.tokens[:-1])
            text = vocabs.target.decode(h.tokens)
            lines += [f"H-{t.index}\t{h.score:.4f}\t{pieces}", f"D-{t.index}\t{h.score:.4f}\t{text}",
                      f"P-{t.index}\t" + " ".join(f"{s:.4f}" for s in h.positional_scores)]
        return lines
    texts = [vocabs.target.decode(h.tokens) for h in t.hypotheses]
    if options.print_scores:
        return [f"{h.score:.4f}\t{text}" for h, text in zip(t.hypotheses, texts)]
    return texts


def generate(options: GenerateOptions) -> list[Translation]:
    """Translate, write the output (atomically to a file, or to stdout) and return the translations."""
    options.validate()
    device = resolve_device(options.device)
    model, vocabs = prepare_model(options.path, device, options.quantize)
    sources, source_texts, references = read_inputs(options, vocabs)
    show = options.progress and stderr_console.is_terminal
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr_console, transient=True, disable=not show) as progress:
        hypotheses = translate(model, sources, options, device, progress)
    seconds = time.perf_counter() - start
    translations = [Translation(i, source_texts[i], hyps, references[i] if references else None)
                    for i, hyps in enumerate(hypotheses)]
    lines = [line for t in translations for line in format_translation(t, vocabs, options)]
    if options.output:
        with atomic_write(options.output) as handle:
            handle.writelines(line + "\n" for line in lines)
    else:
        sys.stdout.writelines(line + "\n" for line in lines)
        sys.stdout.flush()
    output_tokens = sum(len(t.hypotheses[0].tokens) for t in translations if t.hypotheses)
    logger.info("translated %d sentences in %.1f s (%.1f sentences/s, %.0f tokens/s)", len(translations), seconds,
                len(translations) / seconds, output_tokens / seconds)
    if options.score_reference:
        from nmt.scoring import score

        best = [vocabs.target.decode(t.hypotheses[0].tokens) for t in translations]
        for result in score(best, [references]):
            logger.info("%s", result.formatted)
    return translations
