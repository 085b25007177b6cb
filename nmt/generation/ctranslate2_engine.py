"""``nmt generate --engine ctranslate2``: the same inputs and outputs, decoded by CTranslate2.

``--path`` is a directory from ``nmt export ctranslate2``, or a checkpoint, exported (float32) to
a temporary directory first. The search options map onto CTranslate2's: beam, nbest, min length,
no-repeat n-grams, sampling (top-k, top-p, temperature, seed). The max length ``a * |source| + b``
is per sentence, so each batch holds sentences of one max length. ``--quantize int8`` and
``--precision bf16|fp16`` choose CTranslate2's compute type; otherwise (``--quantize auto``
included: the validation check measured nmt's decoder) it computes in the type the export stored.

Where the outputs can differ from nmt's own decoder (with the same weights, in float32):

- Length penalty: CTranslate2 divides by |Y|^alpha (|Y| counting EOS here), fairseq's form; GNMT's
  ((5+|Y|)/6)^alpha cannot be expressed, so ``--lenpen-style gnmt`` (the default) decodes with
  fairseq's form and the same alpha, and the log says so in one line.
- Stopping: CTranslate2 ends a sentence once ``beam`` hypotheses have ended (or, with alpha 0, once
  the best one has); nmt searches on while an unfinished hypothesis could still win. With alpha 0
  the best hypothesis is the same; with alpha != 0, and for ``--nbest`` > 1, some can differ
  (``--stop finished`` gives nmt CTranslate2's rule).
  ``--beam 1`` is plain greedy in CTranslate2; in nmt it too keeps a spare candidate when alpha != 0.
- The max length: nmt ends a hypothesis that reaches it with EOS (scored); CTranslate2 stops it
  there, and EOS is appended here without a score.
- Banned tokens: CTranslate2 removes them before the softmax, nmt after it (as fairseq), so
  CTranslate2's log-probabilities would be higher by the mass the model gave them, per prefix.
  For PAD and BOS that mass is about eps / |V| each after label smoothing eps: enough to flip
  near-ties, so beam search and greedy do not ban them here (scores then equal nmt's; a trained
  model never ranks them among the candidates). Sampling bans them, as nmt's sampling
  renormalizes too. EOS before the min length and repeated n-grams are banned, renormalized.
- Sampling draws from CTranslate2's random generator: other samples than nmt's for the same seed.
- Numerics: different kernels, so near-ties can break the other way.
- Controls: a prefix goes as CTranslate2's ``target_prefix``, banned phrases as its
  ``suppress_sequences`` (one list per call, so the sentences are grouped by what they ban: each
  gets exactly its own bans). For an empty source CTranslate2 returns the prefix alone.
  CTranslate2 has no positive lexical constraints.
- A vocabulary shortlist (the export's vocabulary map): CTranslate2 gives every sentence of a batch
  the candidates of the whole batch, nmt each sentence its own.

Batching, the way CTranslate2 runs fastest (the performance tips and parallelism pages of its
docs): the sentences of one max length and one list of bans go to one ``translate_batch`` call
with ``max_batch_size`` and ``batch_type``, so that CTranslate2 sorts them by length and cuts its
own batches; every call is ``asynchronous``, so that its ``inter_threads`` workers (``--workers``:
by default one per thread on a CPU, each with one intra-op thread, as its docs advise: more
inter_threads rather than intra_threads, their product the threads given) decode several batches
at once, with no Python thread in between. The batch: with ``--max-tokens 0`` (the default) on a
CPU, CTranslate2's best, ``CPU_BATCH_TOKENS`` source pieces a batch (padding included); on a GPU
and for another ``--max-tokens``, nmt's share, ``--max-tokens / (beam * workers)`` source pieces;
``--batch-size`` alone is sentences a batch (``batch_type="examples"``), and with ``--max-tokens``
it caps each call. Outputs come back in input order; in float32 and without a vocabulary map, each
sentence gets what it gets in a batch of its own (tests/test_export_ctranslate2.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from rich.progress import Progress

from nmt.checkpoint.format import Vocabularies
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.errors import NmtError
from nmt.export.ctranslate2 import export_ctranslate2, export_meta, import_ctranslate2, load_vocabularies
from nmt.export.options import ExportOptions
from nmt.generation.inference import (
    Controls,
    TranslateSources,
    check_controls,
    place_batches,
    plan_workload,
    uses_shortlist,
)
from nmt.generation.options import GenerateOptions
from nmt.generation.search import Hypothesis, max_lengths
from nmt.generation.workers import threads_per_worker
from nmt.log import logger

if TYPE_CHECKING:
    import ctranslate2

# CTranslate2's max_batch_size on a CPU with --max-tokens 0 (batch_type "tokens": source pieces a
# batch, padding included). Its fastest batch on the Xeon of issue #40 (beam 4, Multi30k test,
# transformer_small): 277 sentences/s at one thread against 240.9 at nmt's batches; also the batch
# of CTranslate2's WNGT 2020 CPU entry. benchmarks/generate_speed.py sweeps CTranslate2 alone to check it.
CPU_BATCH_TOKENS = 256
PROGRESS_STEP = 32  # sentences: the progress bar advances as each such part of a call has finished


def ctranslate2_search(options: GenerateOptions) -> GenerateOptions:
    """The options as CTranslate2 can follow them: its one length penalty is fairseq's |Y|^alpha, its
    one stop rule nmt's ``finished``."""
    search = options.search
    if search.stop in ("exact", "current") and (search.lenpen != 0 or search.nbest > 1) and not search.sampling:
        logger.warning("--engine ctranslate2 ends a sentence once --beam hypotheses have finished (--stop finished); "
                       "with a length penalty or --nbest > 1, --stop %s can find other translations: --engine nmt "
                       "searches so", search.stop)
    if options.search.lenpen_style == "gnmt" and options.search.lenpen != 0:
        logger.warning("--engine ctranslate2 has no GNMT length penalty ((5+|Y|)/6)^alpha: decoding with fairseq's "
                       "|Y|^%g (--lenpen-style fairseq)", options.search.lenpen)
        return dataclasses.replace(options, search=dataclasses.replace(options.search, lenpen_style="fairseq"))
    return options


def compute_type(options: GenerateOptions, device: torch.device) -> tuple[str, str]:
    """CTranslate2's compute type for ``--quantize`` / ``--precision``, and why. ``auto`` asks
    CTranslate2 itself, whose kernels decide: it refuses bfloat16 on CPUs where nmt's autocast runs it."""
    if options.compute.quantize == "int8":
        return "int8", "--quantize int8"
    if options.compute.precision == "auto":
        if "bfloat16" in import_ctranslate2().get_supported_compute_types(device.type):
            return "bfloat16", f"CTranslate2 runs bfloat16 on this {device.type}"
        return "default", f"CTranslate2 has no bfloat16 on this {device.type}: the export's own type"
    return ({"bf16": "bfloat16", "fp16": "float16"}.get(options.compute.precision, "default"),
            f"--precision {options.compute.precision}")


def load_ctranslate2(options: GenerateOptions, device: torch.device) -> tuple[TranslateSources, Vocabularies]:
    """A function translating source ids with CTranslate2, and the model's vocabularies."""
    options = ctranslate2_search(options)
    if len(options.path) != 1 or ":" in options.path[0] and not Path(options.path[0]).exists():
        raise NmtError("--engine ctranslate2 decodes with one model: give one --path (ensembles need --engine nmt)")
    compute, reason = compute_type(options, device)
    logger.info("CTranslate2 compute type: %s (%s)", compute, reason)
    if options.batching.workers is None:  # as nmt's own decoder: one batch per thread on a CPU
        workers = torch.get_num_threads() if device.type == "cpu" and not options.search.sampling else 1
        options = dataclasses.replace(options, batching=dataclasses.replace(options.batching, workers=workers))
    translator, vocabs, max_positions = open_translator(Path(options.path[0]), device, compute,
                                                        options.batching.workers)
    if options.search.sampling:  # once: a stream's batches draw on, not the same samples again
        import_ctranslate2().set_random_seed(options.search.seed)
    return lambda sources, progress, controls=None, first_line=1: translate_ids_ctranslate2(
        translator, vocabs, sources, options, progress, max_positions, controls, first_line), vocabs


def open_translator(path: Path, device: torch.device, compute: str, workers: int | None = 1
                    ) -> tuple[ctranslate2.Translator, Vocabularies, int | None]:
    """An exported directory as it is; a checkpoint is exported to a temporary directory first
    (the translator reads its files into memory, so the directory can go right after). ``workers``
    batches run at once (CTranslate2's inter_threads), sharing torch's thread count. Also the
    model's positions (None for an export made before nmt.json kept them)."""
    ctranslate2 = import_ctranslate2()
    workers = workers or 1  # unset: one, CTranslate2's own default
    with tempfile.TemporaryDirectory(prefix="nmt-ct2-") as tmp:
        directory = path if path.is_dir() else export_ctranslate2(ExportOptions(str(path), str(Path(tmp) / "model")))
        vocabs, max_positions = load_vocabularies(directory), export_meta(directory).get("max_positions")
        try:
            translator = ctranslate2.Translator(str(directory), device=device.type, device_index=device.index or 0,
                                                compute_type=compute, inter_threads=workers,
                                                intra_threads=threads_per_worker(workers),
                                                max_queued_batches=-1)  # every call is submitted at once
        except (RuntimeError, ValueError) as exc:
            raise NmtError(f"CTranslate2 cannot run {path}: {str(exc).strip().splitlines()[0]}") from exc
    return translator, vocabs, max_positions


def translate_ids_ctranslate2(translator: ctranslate2.Translator, vocabs: Vocabularies, sources: list[np.ndarray],
                              options: GenerateOptions, progress: Progress | None = None,
                              max_positions: int | None = None, controls: Controls | None = None,
                              first_line: int = 1) -> list[list[Hypothesis]]:
    """Like ``translate_ids``: the ``nbest`` hypotheses of each source (ids ending in EOS), in order;
    outputs end before the model's last position, as nmt's own search does. Batched as the module
    docstring says: one asynchronous call per group of sentences sharing a max length and bans."""
    if controls is not None:
        controls = check_controls(sources, controls, options.search, max_positions, first_line)
    workers = options.batching.workers or 1
    work = plan_workload(sources, options.search, options.batching, progress, controls, workers, translator.device)
    limits = max_lengths(torch.as_tensor(work.lengths - 1), options.search.max_len_a, options.search.max_len_b,
                         max_positions).numpy()
    max_batch_size, batch_type = ctranslate2_batch(options, translator.device, work.max_tokens)
    groups: dict[tuple[int, tuple[tuple[int, ...], ...]], list[int]] = {}  # (max length, bans) -> positions in todo
    for position, index in enumerate(work.todo.tolist()):
        bans = tuple(sorted({tuple(ban) for ban in controls[index].bans})) if controls and controls[index] else ()
        groups.setdefault((int(limits[position]), bans), []).append(position)
    calls = []  # (source indices, their pieces, pending results): all submitted at once, CTranslate2's workers take
    for (limit, bans), positions in sorted(groups.items()):  # its batches in turn
        positions = np.asarray(positions)
        positions = positions[np.argsort(-work.lengths[positions], kind="stable")]  # as CTranslate2 sorts: it then
        for part in capped(positions, options.batching.batch_size, batch_type):  # finishes them in this order
            indices = work.todo[part]
            pieces = [[vocabs.source.piece(i) for i in sources[index][:-1]] for index in indices]
            calls.append((indices, pieces, submit(translator, vocabs, pieces, limit, [list(ban) for ban in bans],
                                                  options, [controls[i] for i in indices] if controls else None,
                                                  max_batch_size, batch_type)))
    parts = [(indices[start:start + PROGRESS_STEP], pieces[start:start + PROGRESS_STEP],
              pending[start:start + PROGRESS_STEP])
             for indices, pieces, pending in calls for start in range(0, len(indices), PROGRESS_STEP)]

    def finished() -> Iterator[list[list[Hypothesis]]]:
        for _, pieces, pending in parts:
            hypotheses = [hypotheses_of(result, options.search.nbest, vocabs) for result in results(pending)]
            if options.format == "fairseq":  # its P- lines: each token's log-probability
                add_positional_scores(translator, vocabs, pieces, hypotheses, max_batch_size, batch_type)
            yield hypotheses

    place_batches(work.results, [indices for indices, _, _ in parts], finished(), progress, work.task)
    return work.results


def ctranslate2_batch(options: GenerateOptions, device_type: str, max_tokens: int | None) -> tuple[int, str]:
    """CTranslate2's ``max_batch_size`` and ``batch_type`` for the batching options (``max_tokens``:
    ``plan_workload``'s share of --max-tokens for one batch), as the module docstring says."""
    if max_tokens is None:  # --batch-size alone
        return options.batching.batch_size, "examples"
    if options.batching.max_tokens == 0 and device_type == "cpu":
        return CPU_BATCH_TOKENS, "tokens"
    return max_tokens, "tokens"


def capped(positions: np.ndarray, batch_size: int | None, batch_type: str) -> list[np.ndarray]:
    """A group's positions as calls of at most ``batch_size`` sentences where CTranslate2 batches by
    tokens (it takes one limit a call)."""
    if batch_size is None or batch_type == "examples":
        return [positions]
    return [positions[start:start + batch_size] for start in range(0, len(positions), batch_size)]


def submit(translator: ctranslate2.Translator, vocabs: Vocabularies, batch: list[list[str]], limit: int,
           bans: list[list[int]], options: GenerateOptions, controls: Controls | None, max_batch_size: int,
           batch_type: str) -> list[ctranslate2.AsyncTranslationResult]:
    """One asynchronous ``translate_batch`` call for sources that share the max length ``limit``
    (EOS excluded) and ``bans``; CTranslate2 cuts it into batches of ``max_batch_size``."""
    def pieces(ids):
        return [vocabs.target.piece(i) for i in ids]

    banned = [[vocabs.target.piece(PAD_ID)], [vocabs.target.piece(BOS_ID)]] if options.search.sampling else []
    banned += [pieces(phrase) for phrase in bans]
    prefixes = [pieces(c.prefix) if c and c.prefix else None for c in controls] if controls else None
    with ctranslate2_errors():
        return translator.translate_batch(
            batch, prefixes, max_batch_size=max_batch_size, batch_type=batch_type, asynchronous=True,
            beam_size=1 if options.search.sampling else options.search.beam,
            num_hypotheses=options.search.beam if options.search.sampling else options.search.nbest,
            length_penalty=options.search.lenpen, max_decoding_length=limit,
            min_decoding_length=min(options.search.min_len, limit),
            no_repeat_ngram_size=options.search.no_repeat_ngram_size, suppress_sequences=banned or None,
            max_input_length=0, return_scores=True, return_end_token=True,
            sampling_topk=(options.search.topk or 0) if options.search.sampling else 1,
            sampling_topp=options.search.topp or 1.0,
            sampling_temperature=options.search.temperature,
            use_vmap=uses_shortlist(options.search, vocabs.shortlist, translator.device))


def results(pending: list[ctranslate2.AsyncTranslationResult]) -> Iterator[ctranslate2.TranslationResult]:
    """The results of one call, in its order, as they finish."""
    for result in pending:
        with ctranslate2_errors():
            yield result.result()


@contextlib.contextmanager
def ctranslate2_errors() -> Iterator[None]:
    """CTranslate2's errors as one line (e.g. a sentence longer than the exported position table)."""
    try:
        yield
    except (RuntimeError, ValueError) as exc:
        raise NmtError(f"CTranslate2 failed: {str(exc).strip().splitlines()[0]}") from exc


def hypotheses_of(result: ctranslate2.TranslationResult, nbest: int, vocabs: Vocabularies) -> list[Hypothesis]:
    """One sentence's ``nbest`` hypotheses as token ids ending in EOS."""
    to_id = vocabs.target.processor.piece_to_id
    hyps = []
    for tokens, score in list(zip(result.hypotheses, result.scores))[:nbest]:
        ids = [to_id(token) for token in tokens]
        hyps.append(Hypothesis(ids if ids and ids[-1] == EOS_ID else ids + [EOS_ID], score))
    return hyps


def add_positional_scores(translator: ctranslate2.Translator, vocabs: Vocabularies, batch: list[list[str]],
                          hypotheses: list[list[Hypothesis]], max_batch_size: int = 0, batch_type: str = "examples"
                          ) -> None:
    """Score each hypothesis again, teacher-forced (CTranslate2's search returns only the total)."""
    pairs = [(source, hyp) for source, hyps in zip(batch, hypotheses) for hyp in hyps]
    with ctranslate2_errors():
        scored = translator.score_batch([source for source, _ in pairs],
                                        [[vocabs.target.piece(i) for i in hyp.tokens[:-1]] for _, hyp in pairs],
                                        max_batch_size=max_batch_size, batch_type=batch_type, max_input_length=0)
    for (_, hyp), result in zip(pairs, scored):
        hyp.positional_scores = list(result.log_probs)
