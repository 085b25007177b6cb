"""Translating token ids with nmt's own decoder: the library every surface calls (`nmt generate`, the
Python API, the server, validation BLEU, attention plots, the CTranslate2 engine's batching).

Sources are sorted by length and batched (``max_tokens`` counts source tokens times beam) to cut
padding; hypotheses come back in input order and do not depend on the batching (each sentence's
search is independent, and padding is masked). An empty source (EOS only) gets an empty
translation without running the model, unless its prefix or constraints ask for words. The model
runs under ``torch.inference_mode`` with optional autocast (bf16/fp16), or on CPU with int8 dynamic
quantization of its linear layers, the output projection included (given a module of its own for
it); attention's matrix products stay fp32 then. Each sentence may carry controls (a target
prefix, constraints, banned phrases: nmt/generation/constraints.py) that follow it through the
sorting and batching. A model prepared here decodes with the backend chosen for it once
(``choose_backend``: nmt's C kernels on a CPU where they build, else PyTorch's operations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch
from rich.progress import Progress
from torch import nn

from nmt.backends import int8
from nmt.backends.cpu_backend import CpuKernelsBackend
from nmt.backends.kernel_build import built_kernels
from nmt.backends.torch_backend import TORCH, TorchBackend
from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_from_checkpoint
from nmt.checkpoint.names import refuse_duplicates, split_paths
from nmt.data.batching import batch_by_size, collate
from nmt.data.shortlist import Shortlist
from nmt.data.vocabulary import EOS_ID, UNK_ID
from nmt.device import autocast
from nmt.errors import NmtError
from nmt.generation.candidates import batch_candidates
from nmt.generation.constraints import BatchControls, SentenceControls, contains
from nmt.generation.decoding_settings import stop_for
from nmt.generation.ensemble import Ensemble
from nmt.generation.fused_layers import fuse_int8_layers
from nmt.generation.options import BatchingOptions, SearchOptions, check_workers, choose_workers
from nmt.generation.search import Hypothesis, SearchStopped, beam_search, max_lengths, model_positions
from nmt.generation.workers import KeptWorkers, forks_workers, map_in_workers, threads_per_worker
from nmt.log import logger
from nmt.switches import turned_off

Controls = list[SentenceControls | None]  # one per source
# As translate_ids: sources, a progress bar, controls and the number of the first source in messages.
TranslateSources = Callable[[list[np.ndarray], Progress | None, Controls | None, int], list[list[Hypothesis]]]


def choose_backend(device: torch.device, quantize: str = "none", backend: str = "auto") -> TorchBackend:
    """What a model prepared for decoding on ``device`` computes with (nmt/backends), said in one log
    line: nmt's C kernels on a CPU where they build (built here, before any worker is forked), unless
    ``backend`` is torch or NMT_CPU_KERNELS=0; PyTorch's operations otherwise."""
    chosen, why = TORCH, ""
    if device.type != "cpu":
        why = f"on {device.type}"
    elif backend == "torch":
        why = "--backend torch"
    elif turned_off("NMT_CPU_KERNELS"):
        why = f"NMT_CPU_KERNELS={os.environ['NMT_CPU_KERNELS']}"
    else:
        kernels, why = built_kernels()
        if kernels is not None:
            chosen = CpuKernelsBackend(kernels, int8=quantize == "int8")
            why = "built for this CPU; --backend torch or NMT_CPU_KERNELS=0 for PyTorch's operations"
    # At debug level: an error that follows (a bad input) stays the command's one line; `nmt generate`'s
    # last line names the backend that decoded.
    logger.debug("decoding backend: %s%s", chosen.describe(), f" ({why})" if why else "")
    return chosen


def prepare_model(checkpoint_path: str | Path | list[str], device: torch.device, quantize: str = "none",
                  backend: str = "auto") -> tuple[nn.Module, Vocabularies]:
    """The model of a checkpoint, or an Ensemble of several (``a.pt:b.pt``, or a list; they must share
    vocabularies), for decoding on ``device`` with the backend ``choose_backend`` finds."""
    chosen = choose_backend(device, quantize, backend)
    given = checkpoint_path if isinstance(checkpoint_path, list) else [checkpoint_path]
    paths = [path for item in given for path in split_paths(str(item))]
    refuse_duplicates(paths, " (an ensemble of a model with itself decodes as the model alone, at twice the cost)")
    models, vocabs = [], None
    for path in paths:
        model, its_vocabs = model_from_checkpoint(load_checkpoint(path))
        if vocabs is not None and its_vocabs != vocabs:
            raise NmtError(f"cannot ensemble {path} with {paths[0]}: their vocabularies or languages differ")
        if vocabs is not None and not same_shortlist(vocabs.shortlist, its_vocabs.shortlist):
            logger.info("no vocabulary shortlist: %s and %s have different ones", paths[0], path)
            its_vocabs.shortlist = None
        models.append(inference_model(model, quantize, chosen))
        vocabs = its_vocabs
    return (models[0] if len(models) == 1 else Ensemble(models)).to(device), vocabs


def same_shortlist(a: Shortlist | None, b: Shortlist | None) -> bool:
    return a is b or (a is not None and b is not None and a.to_bytes() == b.to_bytes())


def inference_model(model: nn.Module, quantize: str, backend: TorchBackend) -> nn.Module:
    """The model in eval mode, int8 if asked, decoding with ``backend``."""
    model.eval()
    if quantize == "int8":
        model.separate_output_layer()  # the largest product of every step; int8 only sees modules
        kernels = backend.kernels if isinstance(backend, CpuKernelsBackend) else None
        model = fuse_int8_layers(int8.quantize(model, kernels))
    model.backend = backend
    return model


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
                  progress: Progress | None, controls: Controls | None = None, workers: int = 1,
                  device_type: str = "cpu") -> Workload:
    """Answer the empty sources at once (unless a prefix or constraints ask for output) and size the
    batches of the others (``workers`` at a time, on ``device_type``)."""
    asks = [bool(c and (c.prefix or c.constraints)) for c in controls] if controls else [False] * len(sources)
    todo = np.asarray([i for i, s in enumerate(sources) if len(s) > 1 or asks[i]], dtype=np.int64)
    results = [[] if len(s) > 1 or asks[i] else empty_hypotheses(search.nbest) for i, s in enumerate(sources)]
    lengths = np.fromiter((len(sources[i]) for i in todo), dtype=np.int64, count=len(todo))
    # A sentence's beams take about beam * (source length + some output) rows of work; the
    # workers' batches share the budget, so that more workers do not hold more memory.
    budget = batching.tokens_for(device_type)
    max_tokens = None if budget is None else max(budget // (search.beam * workers), int(lengths.max(initial=1)))
    task = progress.add_task("translating", total=len(sources), completed=len(sources) - len(todo)) \
        if progress else None
    return Workload(results, todo, lengths, max_tokens, task)


@dataclass
class TranslationRequest:
    """How to translate a list of sources with ``translate_ids``: the same for `nmt generate`, the API,
    the server, validation and the decoding check, each of which fills in what it has."""

    search: SearchOptions = field(default_factory=SearchOptions)  # stop auto: exact (see stop_for)
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    controls: Controls | None = None  # one per source (a prefix, constraints, bans), or None
    shortlist: Shortlist | None = None  # the checkpoint's (vocabs.shortlist), used as search.shortlist says
    generator: torch.Generator | None = None  # sampling's draws; None: a new one seeded with search.seed
    first_line: int = 1  # the number of the first source, in messages
    should_stop: Callable[[], bool] | None = None  # asked before each search step (see beam_search)
    fork_workers: bool = False  # workers may be forked here and now (nmt/generation/workers.py)
    kept_workers: KeptWorkers | None = None  # forked workers kept from call to call (a Translator's, generate's)


def translate_ids(model: nn.Module, sources: list[np.ndarray], request: TranslationRequest | None = None,
                  progress: Progress | None = None) -> list[list[Hypothesis]]:
    """The ``nbest`` hypotheses for each source (token ids ending in EOS), in the order given.

    Sampling draws from the request's generator, so that callers translating in several calls (a
    stream) draw on one stream. Controls are checked by ``check_controls``, and the shortlist always
    keeps the pieces of a sentence's prefix and constraints among its candidates. Several workers are
    forked processes only where the request allows it and that is safe and faster (`nmt generate`
    allows it; in a host program whose other threads may hold locks, threads)."""
    request = request or TranslationRequest()
    search = dataclasses.replace(request.search, stop=stop_for(request.search, None))  # a record's: resolved before
    batching, device, controls, generator = request.batching, request.device, request.controls, request.generator
    check_lengths(model, sources, request.first_line)
    check_workers(search, batching, device.type)
    if controls is not None:
        controls = check_controls(sources, controls, search, model_positions(model), request.first_line)
    workers = choose_workers(search, batching, device.type, torch.get_num_threads(), len(sources))
    if search.sampling and generator is None:
        generator = sampling_generator(search, device)
    work = plan_workload(sources, search, batching, progress, controls, workers, device.type)
    shortlist = request.shortlist if uses_shortlist(search, request.shortlist, device.type) else None

    batches = [work.todo[positions]
               for positions in batch_by_size(work.lengths, None, work.max_tokens, batching.batch_size)]
    if workers > 1:  # the longest first: the last to start are short, so the workers finish together
        batches.reverse()
    items = [BatchWork([sources[i] for i in batch], [controls[i] for i in batch] if controls else None, search,
                       device, request.precision, generator, request.should_stop) for batch in batches]
    search_items = functools.partial(search_batch, model, shortlist)
    # Also entered here: with one worker the batches run in this thread, and autocast keeps its
    # low-precision copies of the weights only until its outermost context ends.
    with torch.inference_mode(), autocast(device, request.precision):
        processes = request.should_stop is None and forks_workers(workers)  # (sampling: one worker, never here)
        with contextlib.ExitStack() as held:
            kept = None
            if processes and request.kept_workers is not None:
                kept = held.enter_context(request.kept_workers.use((model, shortlist), search_items, workers,
                                                                   may_fork=request.fork_workers))
            forked = kept is not None or processes and request.fork_workers
            running = kept.workers if kept is not None else workers  # a kept pool may have more than asked
            logger.debug("decoding workers: %s", f"one, {torch.get_num_threads()} intra-op thread(s)" if running == 1
                         else f"{running} {'forked processes' if forked else 'threads of this process'}, "
                              f"{threads_per_worker(workers)} intra-op thread(s) each")
            if kept is not None:
                hypotheses = kept.map(items)
            else:
                hypotheses = map_in_workers(search_items, items, workers, processes=forked)
            held.enter_context(contextlib.closing(hypotheses))  # an error cancels the batches not started, now
            place_batches(work.results, batches, hypotheses, progress, work.task)
    if controls is not None:
        warn_unmet(work.results, controls, request.first_line)
    return work.results


class BatchWork(NamedTuple):
    """One batch's sentences and how to search them: what a worker (a forked one, pickled) gets."""

    sources: list[np.ndarray]
    controls: Controls | None
    search: SearchOptions
    device: torch.device
    precision: str
    generator: torch.Generator | None = None  # sampling's draws (one worker: never forked)
    should_stop: Callable[[], bool] | None = None  # asked before each step (workers that are not forked)


def search_batch(model: nn.Module, shortlist: Shortlist | None, work: BatchWork) -> list[list[Hypothesis]]:
    """beam_search on one batch, under inference mode and autocast (both per thread)."""
    if work.should_stop is not None and work.should_stop():  # before the controls' tables are built, too
        raise SearchStopped("stopped before the batch began")
    controls, device = work.controls, work.device
    with torch.inference_mode(), autocast(device, work.precision):
        batch = collate(range(len(work.sources)), work.sources).to(device)
        batch_controls = BatchControls.create(controls, device) if controls else None
        candidates = None if shortlist is None else batch_candidates(
            shortlist, work.sources, device, [c.required_tokens() if c else () for c in controls] if controls else None)
        return beam_search(model, batch.source, work.search, work.generator, batch_controls, work.should_stop,
                           candidates)


def uses_shortlist(search: SearchOptions, shortlist: Shortlist | None, device_type: str) -> bool:
    """``--shortlist auto``: the checkpoint's on the CPU, except for sampling (which draws from the whole
    distribution). Not on a GPU, where scoring the whole vocabulary costs little and gathering each
    sentence's candidates more: bf16 beam search ran at 0.75x with it on an H200 (docs/performance.md)."""
    return shortlist is not None and search.shortlist == "auto" and not search.sampling and device_type == "cpu"


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


def check_lengths(model: nn.Module, sources: list[np.ndarray], first_line: int = 1) -> None:
    """A source longer than the model's positions is an error before any work, not a failure mid-batch."""
    limit = model_positions(model)
    longest = max(range(len(sources)), key=lambda i: len(sources[i]), default=None)
    if limit is not None and longest is not None and len(sources[longest]) > limit:
        raise NmtError(f"input line {longest + first_line} has {len(sources[longest])} tokens (EOS included), over the "
                       f"model's max_positions {limit}")


def check_controls(sources: list[np.ndarray], controls: Controls, search: SearchOptions, max_positions: int | None,
                   first_line: int = 1) -> Controls:
    """The controls, checked against each sentence's max output length: a longer prefix is an
    error; constraints that cannot fit after the prefix are left out, with a warning naming the
    sentence (it gets its best translation without them)."""
    if len(controls) != len(sources):
        raise NmtError(f"{len(controls)} sentence controls for {len(sources)} sentences")
    if search.sampling and any(c and c.constraints for c in controls):
        raise NmtError("constraints need beam search: they cannot be used with --sampling")
    lengths = torch.tensor([len(s) - 1 for s in sources])  # EOS excluded
    limits = max_lengths(lengths, search.max_len_a, search.max_len_b, max_positions).tolist()
    checked: Controls = []
    for number, (sentence, limit) in enumerate(zip(controls, limits), start=first_line):
        if sentence:
            if len(sentence.prefix) > limit:
                raise NmtError(f"input line {number}: the prefix has {len(sentence.prefix)} pieces, more than its "
                               f"max output length {limit} (--max-len-a/--max-len-b)")
            needed = len(sentence.prefix) + sum(len(p) for p in sentence.constraints
                                                if not contains(sentence.prefix, p))
            if needed > limit:
                logger.warning("input line %d: its constraints need %d output pieces (with its prefix), over its max "
                               "output length %d: translated without them", number, needed, limit)
                sentence = dataclasses.replace(sentence, constraints=[])
        checked.append(sentence or None)
    return checked


def warn_unmet(results: list[list[Hypothesis]], controls: Controls, first_line: int) -> None:
    """A warning for each sentence whose best translation misses a constraint (the search guarantees
    them only when every token of their path may be produced: a ban or --no-repeat-ngram-size can block one)."""
    for number, (hyps, sentence) in enumerate(zip(results, controls), start=first_line):
        if sentence and not all(contains(hyps[0].tokens, phrase) for phrase in sentence.constraints):
            logger.warning("input line %d: its translation misses a constraint (a ban or --no-repeat-ngram-size "
                           "blocked it)", number)


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

