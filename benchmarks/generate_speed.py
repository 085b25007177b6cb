"""Speed of `nmt generate` (beam 4) on Multi30k test against CTranslate2 at its own best, each in its own processes.

    python benchmarks/generate_speed.py --path CKPT --reference REF [--threads 1,2] [--repeats 3] [--lenpen A]
        [--settings shipped,ct2-int8,...] [--ct2-batches tokens:256,examples:32,...] [--ct2-types int8,...]

For the recipe's model (recipes/multi30k_en_de.yaml: `nmt run` trains and averages it, decodes with
lenpen 1.4), from the repository root:

    python benchmarks/generate_speed.py --path checkpoints/multi30k_en_de/averaged.pt \\
        --reference ../shared/data/multi30k/test_2016_flickr.de.gz --lenpen 1.4 --threads 1,2 --repeats 3

Every timed run is a fresh process (``--worker``) that loads its engine, warms it up on 32 sentences
and times one pass over the test set (loading excluded), so that neither engine inherits the other's
threads, allocator, huge pages or warm caches: nmt's processes start themselves as `nmt generate`
does (huge pages for malloc with NMT_HUGE_PAGES=1, nmt/huge_pages.py), then one malloc arena and small oneDNN caches
(``nmt.tune_for_decoding``, nmt/tuning.py), and take their torch threads as its --threads sets them;
CTranslate2's import neither torch nor nmt and run in the environment this script was started in.

Two engines, three tables:

- nmt's rows (--settings): `nmt generate` as it ships (``shipped``: automatic precision, quantization
  and stop rule, the last two as the checkpoint's validation check recorded them, see
  nmt/training/decoding_check.py, and the shortlist; ``--stop`` does not apply to it), fixed
  precisions (fp32, bf16, int8, ...; +shortlist: with the checkpoint's vocabulary shortlist), and
  ct2-TYPE: `nmt generate --engine ctranslate2` on the model exported by `nmt export ctranslate2
  --quantization TYPE` (its compute type chosen as generate chooses it; +shortlist: its vocabulary
  map). With --before, nmt's own settings are also timed in another checkout.
- CTranslate2 alone, swept as its docs advise (its performance tips: ``max_batch_size`` with a large
  input, which CTranslate2 sorts by length and cuts into batches, "tokens" batches, int8 on a CPU,
  ``inter_threads`` rather than ``intra_threads``, their product at most the cores, dynamic vocabulary
  reduction): for each thread count N, every (inter_threads, intra_threads) with product N, every
  batch of --ct2-batches (tokens:SIZE or examples:SIZE), every compute type of --ct2-types, the
  vocabulary map off and on (where the export has one, on a CPU), and the max length either per
  sentence (nmt's rule a * |source| + b: one asynchronous call per max length, as --engine
  ctranslate2 does) or one for all (the longest sentence's: a single call, CTranslate2's plainest
  use). Each setting is timed --sweep-repeats times; the --finalists fastest per thread count are
  then timed --repeats times with nmt's rows, and CTranslate2's best is the fastest median.
- The headline, per thread count: nmt as shipped against CTranslate2 at its best (sentences/s and
  BLEU of each, the ratio), and `--engine ctranslate2` against the same.

nmt's rows and the finalists are timed in --repeats rounds, each round running every one of them
once (the order reversed every other round, so that a slower spell of the machine falls on both
engines); a row gives the median. Sentences/s and tokens/s (output tokens of the best hypothesis,
EOS included) are over the whole set; CPU seconds are the process's (threads and forked workers).
With --reference (the raw German test side), BLEU is given per row.

With --path, the checkpoint translates test_2016_flickr.en and its own max length rule applies
(a * |source| + b, 1 and 50). Without it, a randomly initialised transformer_small (joint BPE
vocabulary of --vocab-size pieces trained on Multi30k train) stands in: a random model never
chooses EOS, so every hypothesis runs to the max length, capped at |source| + 2 tokens (about a
German reference's length) to keep the timing comparable with a trained model's; a ratio counts only
with a trained model. CTranslate2 decodes with fairseq's length penalty (the only one it has) with
the same alpha; nmt with its GNMT one.

A checkpoint from before shortlists gets the one learned from --shortlist-data (its data directory).
With --device cuda both engines decode on the GPU (CTranslate2's sweep: inter_threads 1, larger
batches, its GPU types); seconds are then the figure to read.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

DEFAULT_DATA = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))
SETTINGS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "fp16": ("fp16", "none"),  # (precision, quantize)
            "int8": ("fp32", "int8"), "auto": ("auto", "none"), "shipped": ("auto", "auto")}
SHIPPED = "shipped"  # `nmt generate` without speed flags: auto precision, quantization and stop rule, the shortlist
CT2_SETTINGS = {"ct2-float32": "float32", "ct2-int8": "int8",  # `nmt generate --engine ctranslate2` on this export
                "ct2-float16": "float16", "ct2-bfloat16": "bfloat16", "ct2-int8_float16": "int8_float16"}
GPU_SETTINGS = ("fp16", "ct2-float16", "ct2-int8_float16")  # types a CPU does not compute
SHORTLIST = "+shortlist"  # a setting's suffix: decode with the checkpoint's vocabulary shortlist
HAVE_CT2 = importlib.util.find_spec("ctranslate2") is not None
CPU_BATCHES = "tokens:128,tokens:256,tokens:512,tokens:1024,tokens:2048,tokens:4096,examples:32,examples:64"
GPU_BATCHES = "tokens:1024,tokens:2048,tokens:4096,tokens:8192,tokens:16384,examples:64,examples:256"
WARM_UP = 32  # sentences each process decodes before its timed run
Translator = Callable[[list[str]], list[list[int]]]  # lines -> the best hypothesis's token ids (EOS included)


@dataclass
class Run:
    seconds: float  # wall clock
    cpu_seconds: float  # CPU time of the process: its threads and its forked workers
    outputs: list[list[int]]  # the best hypothesis's token ids, EOS included
    note: str = ""  # what the engine decoded with (nmt's rows)
    pages: str = ""  # the pages malloc got (nmt's rows: nmt/huge_pages.py)


@dataclass(frozen=True)
class Peer:
    """One setting of CTranslate2's sweep."""
    threads: int
    inter: int
    intra: int
    compute_type: str
    batch_type: str
    max_batch_size: int
    limits: str  # "sentence": nmt's per sentence, one call each; "one": the longest's, one call
    vmap: bool

    def describe(self) -> str:
        return (f"{self.compute_type}, {self.inter}x{self.intra} threads, {self.batch_type} {self.max_batch_size}, "
                f"max length {'per sentence' if self.limits == 'sentence' else 'one'}"
                f"{', vocabulary map' if self.vmap else ''}")


@dataclass
class Job:
    """A timed run's description: what its process gets on stdin, and where the timings go."""
    label: str
    threads: int
    payload: dict[str, Any]
    pythonpath: Path | None = None  # nmt's rows timed in another checkout (--before)
    runs: list[Run] = field(default_factory=list)

    def median(self) -> Run:
        runs = sorted(self.runs, key=lambda run: run.seconds)
        return runs[len(runs) // 2]


# -- the processes that time (``--worker``) ----------------------------------------------------------

def worker() -> None:
    """``--worker``: time one run as stdin's JSON asks and print the Run as JSON."""
    if os.environ.get("NMT_BENCHMARK_ENGINE") == "nmt":
        try:  # as `nmt generate` starts itself (an older checkout, --before, may have neither yet)
            from nmt import huge_pages
            huge_pages.restart_with_huge_pages()  # stdin is not read yet: the new process reads it
            from nmt import tune_for_decoding
            tune_for_decoding()  # before torch is imported: one malloc arena, small oneDNN caches
        except ImportError:
            pass
    job = json.loads(sys.stdin.read())
    run = peer_run(job) if job["engine"] == "ctranslate2" else nmt_run(job)
    print(json.dumps(run.__dict__))


def cpu_seconds() -> float:
    """CPU time of this process and of its forked decoding workers: those that have ended, and those
    kept running from call to call (read from /proc, where there is one)."""
    children = multiprocessing.active_children()  # first: it reaps the ended ones, which os.times then counts
    times = os.times()
    running = 0.0
    for child in children:
        try:  # utime and stime: the 14th and 15th fields, the 12th and 13th after the name's ")"
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            running += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return times.user + times.system + times.children_user + times.children_system + running


def timed(translate: Callable[[list[Any]], list[list[int]]], inputs: list[Any]) -> Run:
    """One run after a warm-up (kernels, allocator) on the first sentences."""
    translate(inputs[:WARM_UP])
    wall, cpu = time.perf_counter(), cpu_seconds()
    outputs = translate(inputs)
    return Run(time.perf_counter() - wall, cpu_seconds() - cpu, outputs)


def peer_run(job: dict[str, Any]) -> Run:
    """CTranslate2 alone, as its docs advise (see the module docstring): neither torch nor nmt imported."""
    import ctranslate2

    peer = Peer(**job["peer"])
    translator = ctranslate2.Translator(job["model"], device=job["device"], device_index=job["device_index"],
                                        compute_type=peer.compute_type, inter_threads=peer.inter,
                                        intra_threads=peer.intra, max_queued_batches=-1)
    limits = job["limits"]

    def translate(sentences: list[list[str]]) -> list[list[str]]:
        """The best hypothesis's pieces (EOS excluded) of each sentence, in order."""
        todo = [i for i, pieces in enumerate(sentences) if pieces]  # an empty line is answered by EOS alone
        longest = max((limits[i] for i in todo), default=1)
        groups: dict[int, list[int]] = {}
        for i in todo:
            groups.setdefault(limits[i] if peer.limits == "sentence" else longest, []).append(i)
        calls = [(indices, translator.translate_batch(
            [sentences[i] for i in indices], max_batch_size=peer.max_batch_size, batch_type=peer.batch_type,
            asynchronous=True, beam_size=job["beam"], length_penalty=job["lenpen"], max_decoding_length=limit,
            max_input_length=0, use_vmap=peer.vmap)) for limit, indices in sorted(groups.items())]
        outputs: list[list[str]] = [[] for _ in sentences]
        for indices, pending in calls:
            for i, result in zip(indices, pending):
                outputs[i] = result.result().hypotheses[0]
        return outputs

    return timed(translate, job["pieces"])


def nmt_run(job: dict[str, Any]) -> Run:
    """One of nmt's rows: ``make_translator``'s translator for the setting, on ``threads`` torch threads
    (set as `nmt generate --threads` sets them, and as an older checkout, --before, can)."""
    import torch

    torch.set_num_threads(job["threads"])
    translate, note = make_translator(job["setting"], Path(job["path"]), job["search"], job.get("exports", {}))
    run = timed(translate, job["lines"])
    run.note = note
    try:
        from nmt import huge_pages
        run.pages = huge_pages.describe()
    except ImportError:  # a checkout from before huge pages (--before)
        run.pages = "malloc as it starts"
    return run


def source_ids(vocabs, lines: list[str]) -> list:
    """Each line's source token ids ending in EOS, as both engines take them."""
    import numpy as np

    from nmt.data.vocabulary import EOS_ID
    return [np.asarray(ids + [EOS_ID], dtype=np.int64) for ids in vocabs.source.encode_batch(lines)]


def nmt_translator(path: Path, options) -> Translator:
    """nmt's own decoder, its precision chosen as `nmt generate` chooses it on ``options.compute.device``."""
    from nmt.device import inference_device
    from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids

    device, precision, _ = inference_device(options.compute)
    model, vocabs = prepare_model(path, device, options.compute.quantize)
    try:  # the forked workers kept from call to call, as a Translator and `nmt generate` keep them
        from nmt.generation.workers import KeptWorkers
        kept = {"kept_workers": KeptWorkers()}
    except ImportError:  # a checkout from before (--before): forked for each call
        kept = {}

    def translate(lines: list[str]) -> list[list[int]]:
        request = TranslationRequest(options.search, options.batching, device=device, precision=precision,
                                     shortlist=vocabs.shortlist, fork_workers=True, **kept)  # as generate
        hypotheses = translate_ids(model, source_ids(vocabs, lines), request)
        return [hyps[0].tokens for hyps in hypotheses]

    return translate


def engine_translator(directory: Path, options) -> tuple[Translator, str]:
    """`nmt generate --engine ctranslate2` on an exported directory: its batches, threads and compute type."""
    from nmt.device import resolve_device
    from nmt.generation.ctranslate2_engine import compute_type, load_ctranslate2

    device = resolve_device(options.compute.device)
    translate_sources, vocabs = load_ctranslate2(options, device)

    def translate(lines: list[str]) -> list[list[int]]:
        return [hyps[0].tokens for hyps in translate_sources(source_ids(vocabs, lines), None)]

    return translate, f"CTranslate2 compute type {compute_type(options, device)[0]}"


def make_translator(setting: str, path: Path, search: dict, exports: dict[str, str]) -> tuple[Translator, str]:
    """The translator a row of nmt's table times, and what it decodes with; ``search`` holds beam,
    max_tokens, the length rule and the device; ``exports`` the CTranslate2 directory of each weight
    type. A setting ending in +shortlist uses the checkpoint's vocabulary shortlist (CTranslate2: its
    vocabulary map); the others score the whole vocabulary."""
    import dataclasses

    from nmt.generation.decoding_settings import decoding_settings
    from nmt.generation.options import GenerateOptions
    from nmt.options import build

    setting, shortlisted = setting.removesuffix(SHORTLIST), setting.endswith(SHORTLIST)
    if setting == SHIPPED:  # its stop rule and shortlist are the defaults too
        options = build(GenerateOptions, {"input": "-", **{k: v for k, v in search.items() if k != "stop"}})
        decoding = decoding_settings(options.compute, options.search, str(path))
        return nmt_translator(path, dataclasses.replace(
            options, compute=dataclasses.replace(options.compute, quantize=decoding.quantize),
            search=dataclasses.replace(options.search, stop=decoding.stop))), decoding.describe()
    options = build(GenerateOptions, {"input": "-", **search, "shortlist": "auto" if shortlisted else "none"})
    if setting in CT2_SETTINGS:
        options = build(GenerateOptions, {"input": "-", **search, "shortlist": "auto" if shortlisted else "none",
                                          "path": [exports[CT2_SETTINGS[setting]]], "engine": "ctranslate2",
                                          "lenpen_style": "fairseq"})  # its one length penalty, without a warning
        return engine_translator(Path(exports[CT2_SETTINGS[setting]]), options)
    precision, quantize = SETTINGS[setting]
    return nmt_translator(path, dataclasses.replace(options, compute=dataclasses.replace(
        options.compute, precision=precision, quantize=quantize))), ""


# -- the process that starts them --------------------------------------------------------------------

def random_checkpoint(data: Path, vocab_size: int, directory: Path) -> Path:
    """A randomly initialised transformer_small over a joint BPE vocabulary of Multi30k train, with the
    vocabulary shortlist `nmt preprocess` would learn from it."""
    import torch

    from nmt.checkpoint.format import Vocabularies, model_state, save_checkpoint
    from nmt.data.shortlist import learn_shortlist
    from nmt.data.vocabulary import PAD_ID, Vocabulary
    from nmt.files import read_lines
    from nmt.models.registry import build_model, get_arch

    english, german = read_lines(data / "train.en.gz"), read_lines(data / "train.de.gz")
    vocab = Vocabulary.train(english + german, vocab_size=vocab_size)
    arch = get_arch("transformer_small")
    torch.manual_seed(1)
    model = build_model(arch.model_name, arch.config, len(vocab), len(vocab), PAD_ID)
    shortlist = learn_shortlist(*(flat(vocab.encode_batch(lines)) for lines in (english, german)), len(vocab),
                                len(vocab), joint=True)
    path = directory / "random_transformer_small.pt"
    save_checkpoint(path, model_state(model, arch.name, arch.config,
                                      Vocabularies("en", "de", vocab, vocab, shortlist)))
    return path


def flat(sentences: list[list[int]]):
    """Sentences of token ids as a data directory stores them: flat, each ending in EOS, and n+1 offsets."""
    import numpy as np

    from nmt.data.vocabulary import EOS_ID
    lengths = np.asarray([len(ids) + 1 for ids in sentences])
    return np.concatenate([ids + [EOS_ID] for ids in sentences]), np.concatenate([[0], np.cumsum(lengths)])


def with_shortlist(path: Path, data_dir: Path, directory: Path) -> Path:
    """A copy of a checkpoint from before shortlists, given the one learned from ``data_dir``'s train split
    (the checkpoint's own data: preprocessed before shortlists existed)."""
    from nmt.checkpoint.format import load_checkpoint, save_checkpoint
    from nmt.data.dataset import DataDir
    from nmt.data.shortlist import learn_shortlist

    checkpoint = load_checkpoint(path)
    data = DataDir.open(data_dir)
    if checkpoint["vocab"]["source"] != data.vocabulary(data.source_lang).model_proto:
        raise SystemExit(f"{data_dir} has another vocabulary than {path}")
    train, size = data.split("train"), len(data.vocabulary(data.target_lang))
    shortlist = learn_shortlist((train.source.tokens, train.source.offsets),
                                (train.target.tokens, train.target.offsets), len(data.vocabulary(data.source_lang)),
                                size, joint=data.meta.joint)
    checkpoint["vocab"]["shortlist"] = shortlist.to_bytes()
    copy = directory / f"{path.stem}_with_shortlist.pt"
    save_checkpoint(copy, checkpoint)
    return copy


def run_job(job: Job) -> None:
    """Time ``job`` once in a fresh process and keep its Run."""
    environment = {**os.environ, "NMT_BENCHMARK_ENGINE": job.payload["engine"]}
    if job.pythonpath is not None:
        environment["PYTHONPATH"] = str(job.pythonpath)
    done = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(job.payload), capture_output=True,
                          text=True, env=environment)
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"{job.label} ({job.threads} threads) failed:\n{done.stderr[-3000:]}")
    job.runs.append(Run(**json.loads(done.stdout.strip().splitlines()[-1])))
    sentences = len(job.payload["lines"] if "lines" in job.payload else job.payload["pieces"])
    print(f"{job.label}, {job.threads} thread(s): {sentences / job.runs[-1].seconds:,.1f} sentences/s",
          file=sys.stderr, flush=True)


def thread_splits(threads: int, device_type: str) -> list[tuple[int, int]]:
    """(inter_threads, intra_threads) with product ``threads``; on a GPU one translator (the host's threads)."""
    if device_type != "cpu":
        return [(1, threads)]
    return [(inter, threads // inter) for inter in range(1, threads + 1) if threads % inter == 0]


def parse_batches(text: str) -> list[tuple[str, int]]:
    batches = []
    for item in text.split(","):
        kind, _, size = item.partition(":")
        if kind not in ("tokens", "examples") or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--ct2-batches: {item!r} is not tokens:SIZE or examples:SIZE")
        batches.append((kind, int(size)))
    return batches


def main() -> None:
    if sys.argv[1:] == ["--worker"]:  # a timed run, started by this script
        return worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="a trained checkpoint (default: random transformer_small)")
    parser.add_argument("--reference", type=Path, help="raw reference translations, for BLEU per row")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--limit", type=int, default=0, help="translate only the first N test sentences")
    parser.add_argument("--vocab-size", type=int, default=10000, help="vocabulary of the random model")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--lenpen", type=float, default=0.6, help="length penalty alpha (GNMT's for nmt, "
                        "fairseq's for CTranslate2); the recipe's model decodes with 1.4")
    parser.add_argument("--stop", choices=("exact", "current", "finished"), default="exact",
                        help="nmt's stopping rule for its fixed settings (generate --stop; finished is CTranslate2's)")
    parser.add_argument("--max-tokens", type=int, help="generate --max-tokens for nmt's rows (default: generate's, "
                        "by device; --engine ctranslate2: CTranslate2's best batch on a CPU)")
    parser.add_argument("--device", default="cpu", help="where both engines decode: cpu, cuda or cuda:N (on a GPU "
                        "the threads are the host's; the ct2-float16/-int8_float16 settings are GPU types)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--workers", type=int, help="generate --workers for nmt's rows (CTranslate2's inter_threads "
                        "for --engine ctranslate2); default: one per thread. CTranslate2 alone sweeps its own")
    parser.add_argument("--settings", default=f"{SHIPPED}" + (",ct2-int8" if HAVE_CT2 else ""),
                        help=f"nmt's rows, comma-separated, from {', '.join([*SETTINGS, *CT2_SETTINGS])}, each "
                        f"optionally ending in {SHORTLIST} (decode with the checkpoint's vocabulary shortlist)")
    parser.add_argument("--ct2-batches", help="CTranslate2's batches to sweep, tokens:SIZE or examples:SIZE "
                        f"(default on a CPU: {CPU_BATCHES}; on a GPU: {GPU_BATCHES}); none: no sweep")
    parser.add_argument("--ct2-types", help="CTranslate2's compute types to sweep (default on a CPU: int8, and "
                        "int8_bfloat16 where it runs it; on a GPU: float16, int8_float16)")
    parser.add_argument("--ct2-limits", default="sentence,one", help="max lengths to sweep: sentence (nmt's rule, one "
                        "call per max length), one (the longest sentence's, one call)")
    parser.add_argument("--ct2-vmap", choices=("auto", "off", "on"), default="auto",
                        help="sweep CTranslate2's vocabulary map: auto, off and on where the export has one (CPU)")
    parser.add_argument("--sweep-repeats", type=int, default=1, help="timed runs of each CTranslate2 setting")
    parser.add_argument("--finalists", type=int, default=3, help="CTranslate2's fastest settings per thread count "
                        "timed --repeats times with nmt's rows (0: every setting, no separate sweep)")
    parser.add_argument("--shortlist-data", type=Path, help="a --path checkpoint from before shortlists: the "
                        "data directory it was trained on, whose train split the shortlist is learned from")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of timed runs; a row shows the median")
    parser.add_argument("--before", type=Path, help="another checkout of nmt (e.g. `git worktree add /tmp/before "
                        "COMMIT`): each of nmt's own settings is timed there too, in a row above this checkout's")
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from nmt.data.vocabulary import EOS_ID
    from nmt.device import describe_cpu, resolve_device
    from nmt.errors import NmtError
    from nmt.files import read_lines

    settings = [name for name in args.settings.split(",") if name]
    if unknown := [name for name in settings if name.removesuffix(SHORTLIST) not in [*SETTINGS, *CT2_SETTINGS]]:
        raise SystemExit(f"unknown setting {unknown[0]!r}: choose from {', '.join([*SETTINGS, *CT2_SETTINGS])}")
    if any(name.removesuffix(SHORTLIST) in CT2_SETTINGS for name in settings) and not HAVE_CT2:
        raise SystemExit("the ct2-* settings need CTranslate2: pip install 'nmt[ct2]'")
    test_file = args.data / "test_2016_flickr.en.gz"
    if not test_file.exists():
        raise SystemExit(f"Multi30k not found in {args.data} (set --data or NMT_MULTI30K)")
    try:
        device = resolve_device(args.device)
    except NmtError as exc:
        raise SystemExit(f"error: {exc}") from None
    cpu_only = [name for name in settings if name.endswith(SHORTLIST) or name.removesuffix(SHORTLIST) == "int8"]
    if device.type != "cpu" and cpu_only:
        raise SystemExit(f"{cpu_only[0]} on {args.device}: a GPU decodes without the shortlist, and int8 on the CPU")
    gpu_only = [name for name in settings if name.removesuffix(SHORTLIST) in GPU_SETTINGS]
    if device.type == "cpu" and gpu_only:
        raise SystemExit(f"{gpu_only[0]} is for a GPU (--device cuda)")
    if args.limit < 0:
        raise SystemExit(f"--limit must be 0 (all) or more, got {args.limit}")
    if min(args.repeats, args.sweep_repeats) < 1 or args.finalists < 0:
        raise SystemExit("--repeats and --sweep-repeats must be 1 or more, --finalists 0 or more")
    if args.before and args.workers is not None:
        raise SystemExit("--before times older checkouts, which have no --workers: give one or the other")
    if args.reference and not args.path:
        raise SystemExit("--reference needs --path: BLEU of a random model means nothing")
    limits_modes = args.ct2_limits.split(",")
    if set(limits_modes) - {"sentence", "one"}:
        raise SystemExit(f"--ct2-limits: choose from sentence, one; got {args.ct2_limits}")
    batches = [] if args.ct2_batches == "none" else \
        parse_batches(args.ct2_batches or (CPU_BATCHES if device.type == "cpu" else GPU_BATCHES))
    if batches and not HAVE_CT2:
        Console(stderr=True).print("CTranslate2 is not installed (pip install 'nmt[ct2]'): nmt's rows alone")
        batches = []
    thread_counts = [int(t) for t in args.threads.split(",")]
    lines = read_lines(test_file)[: args.limit or None]
    references = read_lines(args.reference)[: len(lines)] if args.reference else None

    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or random_checkpoint(args.data, args.vocab_size, Path(tmp))
        if args.shortlist_data:
            path = with_shortlist(path, args.shortlist_data, Path(tmp))
        length_rule = dict(max_len_a=1.0, max_len_b=50) if args.path else dict(max_len_a=1.0, max_len_b=2)
        search = dict(beam=args.beam, lenpen=args.lenpen, device=args.device, **length_rule)
        if args.max_tokens is not None:
            search["max_tokens"] = args.max_tokens
        if args.stop != "exact":  # older checkouts (--before) have no stop option
            search["stop"] = args.stop
        if args.workers is not None:  # nor workers
            search["workers"] = args.workers

        exports: dict[str, str] = {}  # weight type -> `nmt export ctranslate2` of the checkpoint

        def export(quantization: str) -> str:
            from nmt.export.ctranslate2 import export_ctranslate2
            from nmt.export.options import ExportOptions
            if quantization not in exports:
                exports[quantization] = str(export_ctranslate2(ExportOptions(str(path), str(Path(tmp) / f"ct2-"
                                                                                    f"{quantization}"), quantization)))
            return exports[quantization]

        for name in settings:
            if name.removesuffix(SHORTLIST) in CT2_SETTINGS:
                export(CT2_SETTINGS[name.removesuffix(SHORTLIST)])
        nmt_jobs = []
        for threads in thread_counts:
            for name in settings:
                payload = dict(engine="nmt", setting=name, path=str(path), search=search, lines=lines, threads=threads,
                               exports=exports)
                if args.before and name.removesuffix(SHORTLIST) in SETTINGS:
                    nmt_jobs.append(Job(f"{name} (before)", threads, payload, pythonpath=args.before))
                nmt_jobs.append(Job(name, threads, payload))

        peer_jobs: list[Job] = []
        vocabs = None
        if batches:  # CTranslate2 converts the float32 export to each compute type as it loads
            directory = Path(export("float32"))
            peer_jobs, vocabs = sweep_jobs(directory, lines, length_rule, args, device, thread_counts, batches,
                                           limits_modes)

        finalists = list(peer_jobs)
        if peer_jobs and args.finalists:  # the sweep: each setting on its own, the fastest then timed with nmt's rows
            for _ in range(args.sweep_repeats):
                for job in peer_jobs:
                    run_job(job)
            sweep = {id(job): len(lines) / job.median().seconds for job in peer_jobs}
            finalists = []
            for threads in thread_counts:
                ranked = sorted((job for job in peer_jobs if job.threads == threads), key=lambda j: -sweep[id(j)])
                finalists += ranked[: args.finalists]
            for job in finalists:
                job.runs.clear()
        else:
            sweep = {}
        rounds = interleave(nmt_jobs, finalists)
        for round_number in range(args.repeats):
            for job in rounds if round_number % 2 == 0 else rounds[::-1]:
                run_job(job)

        model_name = str(args.path) if args.path else f"random transformer_small, vocab {args.vocab_size}"
        title = (f"beam {args.beam}, lenpen {args.lenpen:g}, Multi30k test_2016_flickr ({len(lines):,} sentences), "
                 f"{model_name}, max length {length_rule['max_len_a']:g}*src+{length_rule['max_len_b']}, "
                 f"{describe_cpu()}" + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
                 + f", torch {torch.__version__}")
        if peer_jobs:
            title += f", CTranslate2 {importlib.metadata.version('ctranslate2')}"
        target = vocabs.target if vocabs is not None else checkpoint_vocabularies(path).target
        for job in peer_jobs:  # CTranslate2's pieces as ids ending in EOS, as nmt's
            for run in job.runs:
                run.outputs = [[target.processor.piece_to_id(p) for p in hyp] + [EOS_ID] for hyp in run.outputs]
        bleu = (lambda outputs: score_bleu(target, outputs, references)) if references else None
        console = Console(width=250)
        pages = sorted({run.pages for job in nmt_jobs for run in job.runs})
        console.print(nmt_table(nmt_jobs, lines, bleu, f"nmt generate: {title}, stop {args.stop} (fixed settings), "
                                f"max tokens {args.max_tokens or 'by device'}, {args.workers or 'default'} worker(s), "
                                f"{' / '.join(pages)}"))
        if peer_jobs:
            console.print(peer_table(peer_jobs, finalists, sweep, lines, bleu,
                                     f"CTranslate2 alone, each setting in its own process: {title}"))
            caveat = "" if args.path else " (a random model: no ratio counts, see the module docstring)"
            console.print(headline(nmt_jobs, finalists, thread_counts, lines, bleu,
                                   f"nmt as shipped against CTranslate2 at its best{caveat}: {title}"))


def sweep_jobs(directory: Path, lines: list[str], length_rule: dict, args, device, thread_counts: list[int],
               batches: list[tuple[str, int]], limits_modes: list[str]) -> tuple[list[Job], Any]:
    """The runs of CTranslate2's sweep (see the module docstring) on the export in ``directory``, and its
    vocabularies."""
    import ctranslate2
    import torch

    from nmt.export.ctranslate2 import export_meta, load_vocabularies
    from nmt.generation.search import max_lengths

    vocabs, max_positions = load_vocabularies(directory), export_meta(directory).get("max_positions")
    ids = source_ids(vocabs, lines)
    limits = max_lengths(torch.tensor([len(s) - 1 for s in ids]), length_rule["max_len_a"], length_rule["max_len_b"],
                         max_positions).tolist()
    pieces = [[vocabs.source.piece(int(i)) for i in s[:-1]] for s in ids]
    supported = ctranslate2.get_supported_compute_types(device.type)
    types = args.ct2_types.split(",") if args.ct2_types else \
        [t for t in (("int8", "int8_bfloat16") if device.type == "cpu" else ("float16", "int8_float16"))
         if t in supported]
    has_map = (directory / "vmap.txt").is_file() and device.type == "cpu"
    vmaps = {"auto": [False, True] if has_map else [False], "off": [False], "on": [True]}[args.ct2_vmap]
    if True in vmaps and not has_map:
        raise SystemExit("--ct2-vmap on: the export has no vocabulary map (a checkpoint without a shortlist, see "
                         "--shortlist-data), or decodes on a GPU")
    jobs = []
    for threads in thread_counts:
        for inter, intra in thread_splits(threads, device.type):
            for compute, (batch_type, size), mode, vmap in itertools.product(types, batches, limits_modes, vmaps):
                peer = Peer(threads, inter, intra, compute, batch_type, size, mode, vmap)
                jobs.append(Job(peer.describe(), threads, dict(
                    engine="ctranslate2", peer=peer.__dict__, model=str(directory), device=device.type,
                    device_index=device.index or 0, limits=limits, beam=args.beam, lenpen=args.lenpen,
                    pieces=pieces)))
    return jobs, vocabs


def interleave(ours: list[Job], theirs: list[Job]) -> list[Job]:
    """One round: the two engines' jobs in turn (per thread count), so that neither runs all at once."""
    order = []
    for threads in sorted({job.threads for job in ours + theirs}):
        a, b = [j for j in ours if j.threads == threads], [j for j in theirs if j.threads == threads]
        for i in range(max(len(a), len(b))):
            order += a[i:i + 1] + b[i:i + 1]
    return order


def checkpoint_vocabularies(path: Path):
    from nmt.checkpoint.format import load_checkpoint, model_from_checkpoint
    return model_from_checkpoint(load_checkpoint(path))[1]


def score_bleu(target, outputs: list[list[int]], references: list[str]) -> float:
    from nmt.scoring import score
    return score([target.decode(tokens) for tokens in outputs], [references])[0].score


def speed(job: Job, lines: list[str]) -> float:
    return len(lines) / job.median().seconds


def nmt_table(jobs: list[Job], lines: list[str], bleu, title: str):
    from rich.table import Table

    table = Table(title=title)
    columns = ["setting", "threads", "seconds", "CPU seconds", "sentences/s", "sentences/CPU-s", "tokens/s",
               "same output as fp32", "decodes with"]
    for column in columns + (["BLEU"] if bleu else []):
        table.add_column(column, justify="right")
    fp32 = {job.threads: job.median().outputs for job in jobs if job.label == "fp32"}
    reference = next(iter(fp32.values()), None)
    for job in jobs:
        run = job.median()
        same = "n/a" if reference is None else \
            f"{sum(a == b for a, b in zip(run.outputs, reference)) / len(lines):.0%}"
        row = [job.label, str(job.threads), f"{run.seconds:.2f}", f"{run.cpu_seconds:.2f}",
               f"{len(lines) / run.seconds:,.1f}", f"{len(lines) / run.cpu_seconds:,.1f}",
               f"{sum(map(len, run.outputs)) / run.seconds:,.0f}", same, run.note]
        table.add_row(*row, *([f"{bleu(run.outputs):.2f}"] if bleu else []))
    return table


def peer_table(jobs: list[Job], finalists: list[Job], sweep: dict[int, float], lines: list[str], bleu,
               title: str):
    """Every setting of CTranslate2's sweep, the fastest first per thread count."""
    from rich.table import Table

    table = Table(title=title)
    columns = ["threads", "compute type", "inter x intra", "batch", "max length", "vocabulary map"]
    columns += ["sentences/s (sweep)", "sentences/s (median, with nmt)"] if sweep else ["sentences/s (median)"]
    columns += ["tokens/s", "CPU seconds"] + (["BLEU"] if bleu else []) + [""]
    for column in columns:
        table.add_column(column, justify="right")
    chosen = {id(job) for job in finalists}
    best = {threads: max((j for j in finalists if j.threads == threads), key=lambda j: speed(j, lines))
            for threads in {j.threads for j in finalists}}
    for job in sorted(jobs, key=lambda j: (j.threads, -sweep.get(id(j), speed(j, lines)))):
        peer, run = Peer(**job.payload["peer"]), job.median()
        speeds = [f"{sweep[id(job)]:,.1f}", f"{speed(job, lines):,.1f}" if id(job) in chosen else ""] if sweep \
            else [f"{speed(job, lines):,.1f}"]
        table.add_row(str(job.threads), peer.compute_type, f"{peer.inter} x {peer.intra}",
                      f"{peer.batch_type} {peer.max_batch_size}",
                      "per sentence" if peer.limits == "sentence" else "one", "on" if peer.vmap else "off", *speeds,
                      f"{sum(map(len, run.outputs)) / run.seconds:,.0f}", f"{run.cpu_seconds:.2f}",
                      *([f"{bleu(run.outputs):.2f}"] if bleu else []), "best" if best[job.threads] is job else "")
    return table


def headline(nmt_jobs: list[Job], finalists: list[Job], thread_counts: list[int], lines: list[str], bleu,
             title: str):
    """Per thread count: nmt as shipped (else its fastest row) and `--engine ctranslate2` (its fastest
    row) against CTranslate2 at its best."""
    from rich.table import Table

    table = Table(title=title)
    scored = ["sentences/s"] + (["BLEU"] if bleu else [])
    for column in ["threads", "nmt", *scored, "CTranslate2 at its best", *scored, "nmt / CTranslate2",
                   "generate --engine ctranslate2", *scored, "engine / CTranslate2"]:
        table.add_column(column, justify="right")

    def cells(job: Job | None) -> list[str]:
        if job is None:
            return ["n/a"] * len(scored + [""])
        return [job.label, f"{speed(job, lines):,.1f}"] + ([f"{bleu(job.median().outputs):.2f}"] if bleu else [])

    def ratio(job: Job | None, best: Job) -> str:
        return f"{speed(job, lines) / speed(best, lines):.2f}x" if job else "n/a"

    for threads in thread_counts:
        ours = [j for j in nmt_jobs if j.threads == threads and j.pythonpath is None]
        own = [j for j in ours if j.label.removesuffix(SHORTLIST) in SETTINGS]
        theirs = [j for j in finalists if j.threads == threads]
        if not theirs:
            continue
        best = max(theirs, key=lambda j: speed(j, lines))
        nmt = next((j for j in own if j.label == SHIPPED), None) or \
            max(own, key=lambda j: speed(j, lines), default=None)
        engine = max((j for j in ours if j.label.removesuffix(SHORTLIST) in CT2_SETTINGS),
                     key=lambda j: speed(j, lines), default=None)
        table.add_row(str(threads), *cells(nmt), *cells(best), ratio(nmt, best), *cells(engine), ratio(engine, best))
    return table


if __name__ == "__main__":
    main()
