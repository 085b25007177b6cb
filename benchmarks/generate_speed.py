"""Speed of `nmt generate` (beam 4) on Multi30k test: as shipped, fp32, bf16, int8, CTranslate2; 1 and 2 threads.

    python benchmarks/generate_speed.py [--path CKPT [--reference REF] [--shortlist-data DIR]] [--data DIR] [--limit N]

With --path, the checkpoint translates test_2016_flickr.en and its own max length rule applies
(a * |source| + b, defaults 1 and 50). Without it, a randomly initialised transformer_small (joint
BPE vocabulary of --vocab-size pieces trained on Multi30k train) stands in: a random model never
chooses EOS, so every hypothesis runs to the max length, which is capped at |source| + 2 tokens
(about the length of a German reference) to keep the timing comparable with a trained model's.
With --reference (the raw German test side), the table also gives BLEU per precision, the cost of
bf16 and int8. Sentences/s and tokens/s (output tokens of the best hypothesis, EOS included) are
over the whole set, model loading excluded; each row is the median of --repeats runs. With one
thread, CPU seconds (this process's) are the steadier figure on a machine shared with other jobs.

With CTranslate2 installed (pip install 'nmt[ct2]'), the settings ct2-float32 and ct2-int8 decode
the same model exported by `nmt export ctranslate2`, through the function behind `nmt generate
--engine ctranslate2` (same batches, beam, max length, threads; fairseq's length penalty with the
same alpha, as CTranslate2 has no other), and a second table gives the ratios nmt / CTranslate2.

A setting ending in +shortlist (fp32+shortlist, int8+shortlist, ct2-int8+shortlist, ...) decodes with
the checkpoint's vocabulary shortlist (`--shortlist auto`; CTranslate2: the exported vocabulary map,
`use_vmap`); the others score the whole vocabulary. The random model gets the shortlist learned from
Multi30k train; a --path checkpoint from before shortlists gets the one of --shortlist-data (its data
directory). The ratio table then also compares the fastest of each engine with the shortlist.

The setting shipped is `nmt generate` as it ships, without speed flags: automatic precision,
quantization and stop rule (the last two as the checkpoint's validation check recorded them, see
nmt/generation/decoding_check.py; `--stop` does not apply to it) and the shortlist; the ratio table
sets it against CTranslate2's fastest setting.

With --device cuda both engines decode on the GPU, nmt in the precision `auto` picks there (or the
setting's), CTranslate2 in its GPU types too (ct2-float16, ct2-bfloat16, ct2-int8_float16); the threads
are the host's. Seconds are then the figure to read (a GPU's time is no CPU time).

Each row times a translator (a function from lines to token ids) that ``make_translator`` makes
for its setting; another engine is one more translator factory beside ``nmt_translator``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_state, save_checkpoint
from nmt.data.dataset import DataDir
from nmt.data.shortlist import learn_shortlist
from nmt.data.vocabulary import EOS_ID, PAD_ID, Vocabulary
from nmt.device import inference_device, resolve_device
from nmt.errors import NmtError
from nmt.files import read_lines
from nmt.generation.decoding_check import decoding_settings
from nmt.generation.inference import prepare_model, translate_ids
from nmt.generation.options import GenerateOptions
from nmt.models.registry import build_model, get_arch
from nmt.options import build
from nmt.scoring import score

DEFAULT_DATA = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))
SETTINGS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "fp16": ("fp16", "none"),  # (precision, quantize)
            "int8": ("fp32", "int8"), "auto": ("auto", "none"), "shipped": ("auto", "auto")}
SHIPPED = "shipped"  # `nmt generate` without speed flags: auto precision, quantization and stop rule, the shortlist
CT2_SETTINGS = {"ct2-float32": "float32", "ct2-int8": "int8",  # the weight type the export stores
                "ct2-float16": "float16", "ct2-bfloat16": "bfloat16", "ct2-int8_float16": "int8_float16"}
GPU_SETTINGS = ("fp16", "ct2-float16", "ct2-int8_float16")  # types a CPU does not compute
SHORTLIST = "+shortlist"  # a setting's suffix: decode with the checkpoint's vocabulary shortlist
HAVE_CT2 = importlib.util.find_spec("ctranslate2") is not None
Translator = Callable[[list[str]], list[list[int]]]  # lines -> the best hypothesis's token ids (EOS included)


@dataclass
class Run:
    seconds: float  # wall clock
    cpu_seconds: float  # CPU time (this process's and its workers'): steadier than wall time on a shared machine
    outputs: list[list[int]]


def random_checkpoint(data: Path, vocab_size: int, directory: Path) -> Path:
    """A randomly initialised transformer_small over a joint BPE vocabulary of Multi30k train, with the
    vocabulary shortlist `nmt preprocess` would learn from it."""
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


def flat(sentences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sentences of token ids as a data directory stores them: flat, each ending in EOS, and n+1 offsets."""
    lengths = np.asarray([len(ids) + 1 for ids in sentences])
    return np.concatenate([ids + [EOS_ID] for ids in sentences]), np.concatenate([[0], np.cumsum(lengths)])


def with_shortlist(path: Path, data_dir: Path, directory: Path) -> Path:
    """A copy of a checkpoint from before shortlists, given the one learned from ``data_dir``'s train split
    (the checkpoint's own data: preprocessed before shortlists existed)."""
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


def source_ids(vocabs: Vocabularies, lines: list[str]) -> list[np.ndarray]:
    """Each line's source token ids ending in EOS, as both engines take them."""
    return [np.asarray(ids + [EOS_ID], dtype=np.int64) for ids in vocabs.source.encode_batch(lines)]


def nmt_translator(path: Path, options: GenerateOptions) -> Translator:
    """nmt's own decoder, its precision chosen as `nmt generate` chooses it on ``options.compute.device``."""
    device, precision, _ = inference_device(options.compute)
    model, vocabs = prepare_model(path, device, options.compute.quantize)

    def translate(lines: list[str]) -> list[list[int]]:
        hypotheses = translate_ids(model, source_ids(vocabs, lines), options.search, options.batching, device=device,
                                   precision=precision, shortlist=vocabs.shortlist, fork_workers=True)  # as generate
        return [hyps[0].tokens for hyps in hypotheses]

    return translate


def ct2_translator(path: Path, options: GenerateOptions, quantization: str, workdir: Path) -> Translator:
    """The model exported to CTranslate2 (once per weight type, into ``workdir``), decoded as
    `--engine ctranslate2` does, with torch's thread count (shared among --workers, its inter_threads)."""
    from nmt.export.ctranslate2 import export_ctranslate2
    from nmt.export.options import ExportOptions
    from nmt.generation.ctranslate2_engine import open_translator, translate_ids_ctranslate2

    directory = workdir / f"ct2-{quantization}"
    if not directory.exists():
        export_ctranslate2(ExportOptions(str(path), str(directory), quantization))
    translator, vocabs, max_positions = open_translator(directory, resolve_device(options.compute.device),
                                                        "default",  # the stored type
                                                        options.batching.workers)
    options = dataclasses.replace(options, search=dataclasses.replace(options.search, lenpen_style="fairseq"))

    def translate(lines: list[str]) -> list[list[int]]:
        hypotheses = translate_ids_ctranslate2(translator, vocabs, source_ids(vocabs, lines), options,
                                                 max_positions=max_positions)
        return [hyps[0].tokens for hyps in hypotheses]

    return translate


def make_translator(setting: str, path: Path, search: dict, workdir: Path) -> Translator:
    """The translator a table row times; ``search`` holds beam, max_tokens, the length rule and the device. A
    setting ending in +shortlist uses the checkpoint's vocabulary shortlist (CTranslate2: its vocabulary
    map); the others score the whole vocabulary."""
    setting, shortlisted = setting.removesuffix(SHORTLIST), setting.endswith(SHORTLIST)
    if setting == SHIPPED:  # its stop rule and shortlist are the defaults too
        options = build(GenerateOptions, {"input": "-", **{k: v for k, v in search.items() if k != "stop"}})
        decoding = decoding_settings(options.compute, options.search, str(path))
        Console(stderr=True).print(f"as shipped: {decoding.describe()}")
        return nmt_translator(path, dataclasses.replace(
            options, compute=dataclasses.replace(options.compute, quantize=decoding.quantize),
            search=dataclasses.replace(options.search, stop=decoding.stop)))
    options = build(GenerateOptions, {"input": "-", **search, "shortlist": "auto" if shortlisted else "none"})
    if setting in CT2_SETTINGS:
        return ct2_translator(path, options, CT2_SETTINGS[setting], workdir)
    precision, quantize = SETTINGS[setting]
    return nmt_translator(path, dataclasses.replace(options, compute=dataclasses.replace(
        options.compute, precision=precision, quantize=quantize)))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (forked decoding workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def time_translation(translate: Translator, lines: list[str], repeats: int) -> Run:
    """The median of ``repeats`` timed runs (wall and CPU time), after a short warm-up."""
    translate(lines[:32])  # warm-up: kernels, allocator
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), cpu_seconds()
        outputs = translate(lines)
        runs.append(Run(time.perf_counter() - wall, cpu_seconds() - cpu, outputs))
    runs.sort(key=lambda run: run.seconds)
    return runs[len(runs) // 2]


def time_elsewhere(nmt_dir: Path, setting: str, path: Path, search: dict, lines: list[str], repeats: int,
                   threads: int) -> Run:
    """The same timing with the nmt package at ``nmt_dir`` (another checkout: the "before" rows of nmt's
    own settings)."""
    job = json.dumps(dict(setting=setting, path=str(path), search=search, lines=lines, repeats=repeats,
                          threads=threads))
    env = {**os.environ, "PYTHONPATH": str(nmt_dir)}
    done = subprocess.run([sys.executable, __file__, "--worker"], input=job, capture_output=True, text=True,
                          env=env, check=True)
    return Run(**json.loads(done.stdout))


def worker() -> None:
    """``--worker``: time one setting as stdin's JSON asks and print the Run as JSON."""
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    with tempfile.TemporaryDirectory() as workdir:
        translate = make_translator(job["setting"], Path(job["path"]), job["search"], Path(workdir))
        run = time_translation(translate, job["lines"], job["repeats"])
    print(json.dumps(run.__dict__))


def ratio_table(speeds: dict[tuple[str, int], float]) -> Table:
    """nmt / CTranslate2 sentences/s per thread count: as shipped against CTranslate2's fastest, float32
    against float32, fastest against fastest
    (CTranslate2 as it ships, without a vocabulary map), and fastest against fastest with the shortlist."""
    table = Table(title="nmt / CTranslate2 (ratio of sentences/s, same threads)")
    for column in ("threads", "as shipped / fastest ct2", "fp32 / ct2-float32", "fastest nmt / fastest ct2",
                   "with the shortlist: fastest / fastest"):
        table.add_column(column, justify="right")

    def fastest(names: dict[str, float]) -> str:
        return max(names, key=names.get) if names else ""

    for threads in sorted({t for _, t in speeds}):
        ours = {name: v for (name, t), v in speeds.items() if t == threads and name.removesuffix(SHORTLIST) in SETTINGS}
        theirs = {name: v for (name, t), v in speeds.items() if t == threads and name in CT2_SETTINGS}
        theirs_mapped = {name: v for (name, t), v in speeds.items()
                         if t == threads and name.endswith(SHORTLIST) and name.removesuffix(SHORTLIST) in CT2_SETTINGS}
        if not ours or not (theirs or theirs_mapped):
            continue
        same_type = f"{ours['fp32'] / theirs['ct2-float32']:.2f}x" if "fp32" in ours and "ct2-float32" in theirs \
            else "n/a"
        best, best_ct2 = fastest(ours), fastest(theirs)
        shortlisted = {name: v for name, v in ours.items() if name.endswith(SHORTLIST) or name == SHIPPED}
        best_shortlisted, best_mapped = fastest(shortlisted), fastest(theirs_mapped)
        shipped = f"{ours[SHIPPED] / theirs[best_ct2]:.2f}x ({SHIPPED} / {best_ct2})" \
            if SHIPPED in ours and theirs else "n/a"
        table.add_row(str(threads), shipped, same_type,
                      f"{ours[best] / theirs[best_ct2]:.2f}x ({best} / {best_ct2})" if theirs else "n/a",
                      f"{shortlisted[best_shortlisted] / theirs_mapped[best_mapped]:.2f}x "
                      f"({best_shortlisted} / {best_mapped})" if shortlisted and theirs_mapped else "n/a")
    return table


def main() -> None:
    if sys.argv[1:] == ["--worker"]:  # started by this script, which restarted first (below)
        return worker()
    from nmt import huge_pages  # neither is in older checkouts, which --before imports in --worker
    from nmt.device import describe_cpu
    huge_pages.restart_with_huge_pages()  # as `nmt` starts itself: what it decodes with (nmt/huge_pages.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="a trained checkpoint (default: random transformer_small)")
    parser.add_argument("--reference", type=Path, help="raw reference translations, for BLEU per precision")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--limit", type=int, default=0, help="translate only the first N test sentences")
    parser.add_argument("--vocab-size", type=int, default=10000, help="vocabulary of the random model")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--lenpen", type=float, default=0.6, help="length penalty alpha (GNMT's for nmt, "
                        "fairseq's for CTranslate2)")
    parser.add_argument("--stop", choices=("exact", "finished"), default="exact",
                        help="nmt's stopping rule (generate --stop; finished is CTranslate2's)")
    parser.add_argument("--max-tokens", type=int, help="generate --max-tokens for every row (default: generate's, "
                        "by device: 8,000 on a CPU, 32,000 on a GPU; older checkouts' own with --before)")
    parser.add_argument("--device", default="cpu", help="where both engines decode: cpu, cuda or cuda:N (on a GPU "
                        "the threads are the host's; the ct2-float16/-bfloat16/-int8_float16 settings are GPU types)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--workers", type=int, help="batches decoded at once, sharing the threads (generate "
                        "--workers; CTranslate2's inter_threads); default: each engine's own (nmt: one per thread)")
    parser.add_argument("--settings", default="fp32,bf16,int8" + (",ct2-float32,ct2-int8" if HAVE_CT2 else ""),
                        help=f"comma-separated, from {', '.join([*SETTINGS, *CT2_SETTINGS])}, each optionally "
                        f"ending in {SHORTLIST} (decode with the checkpoint's vocabulary shortlist)")
    parser.add_argument("--shortlist-data", type=Path, help="a --path checkpoint from before shortlists: the "
                        "data directory it was trained on, whose train split the shortlist is learned from")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the table shows the median")
    parser.add_argument("--before", type=Path, help="another checkout of nmt (e.g. `git worktree add /tmp/before "
                        "COMMIT`): each of nmt's own settings is timed there too, in a row above this checkout's")
    args = parser.parse_args()
    settings = args.settings.split(",")
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
    if args.before and args.workers is not None:
        raise SystemExit("--before times older checkouts, which have no --workers: give one or the other")
    if args.reference and not args.path:
        raise SystemExit("--reference needs --path: BLEU of a random model means nothing")
    lines = read_lines(test_file)[: args.limit or None]
    references = read_lines(args.reference)[: len(lines)] if args.reference else None

    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or random_checkpoint(args.data, args.vocab_size, Path(tmp))
        if args.shortlist_data:
            path = with_shortlist(path, args.shortlist_data, Path(tmp))
        model_name = str(args.path) if args.path else f"random transformer_small, vocab {args.vocab_size}"
        length_rule = dict(max_len_a=1.0, max_len_b=50) if args.path else dict(max_len_a=1.0, max_len_b=2)
        table = Table(title=f"nmt generate, beam {args.beam}, lenpen {args.lenpen:g}, stop {args.stop}, "
                            f"max tokens {args.max_tokens or 'by device'}, "
                            f"{args.workers or 'default'} worker(s), "
                            f"Multi30k test_2016_flickr ({len(lines):,} sentences), "
                            f"{model_name}, max length {length_rule['max_len_a']:g}*src+{length_rule['max_len_b']}, "
                            f"{describe_cpu()}{gpu}, torch {torch.__version__}, {huge_pages.describe()}")
        columns = ["setting", "threads", "seconds", "CPU seconds", "sentences/s", "sentences/CPU-s", "tokens/s",
                   "vs first row (CPU)", "same output as fp32"]
        for column in columns + (["BLEU"] if references else []):
            table.add_column(column, justify="right")
        fp32_outputs = None  # of the first fp32 run
        first = None  # sentences per CPU-second of the first row, what the others are compared with
        speeds: dict[tuple[str, int], float] = {}  # (setting, threads) -> sentences/s, this checkout's rows
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for name in settings:
                search = dict(beam=args.beam, lenpen=args.lenpen, device=args.device, **length_rule)
                if args.max_tokens is not None:
                    search["max_tokens"] = args.max_tokens
                if args.stop != "exact":  # older checkouts (--before) have no stop option
                    search["stop"] = args.stop
                if args.workers is not None:  # nor workers
                    search["workers"] = args.workers
                timings = [(name, lambda: time_translation(make_translator(name, Path(path), search, Path(tmp)),
                                                           lines, args.repeats))]
                if args.before and name.removesuffix(SHORTLIST) in SETTINGS:
                    timings.insert(0, (f"{name} (before)", lambda: time_elsewhere(
                        args.before, name, Path(path), search, lines, args.repeats, threads)))
                for label, timed in timings:
                    run = timed()
                    fp32_outputs = fp32_outputs or (run.outputs if name == "fp32" else None)
                    tokens = sum(len(tokens) for tokens in run.outputs)
                    same = "n/a" if fp32_outputs is None else \
                        f"{sum(a == b for a, b in zip(run.outputs, fp32_outputs)) / len(lines):.0%}"
                    per_cpu_second = len(lines) / run.cpu_seconds
                    first = first or per_cpu_second
                    if label == name:
                        speeds[name, threads] = len(lines) / run.seconds
                    row = [label, str(threads), f"{run.seconds:.1f}", f"{run.cpu_seconds:.1f}",
                           f"{len(lines) / run.seconds:,.1f}", f"{per_cpu_second:,.1f}", f"{tokens / run.seconds:,.0f}",
                           f"{per_cpu_second / first:.2f}x", same]
                    if references:
                        _, vocabs = prepare_model(path, torch.device("cpu"), "none")
                        bleu = score([vocabs.target.decode(t) for t in run.outputs], [references])[0].score
                        row.append(f"{bleu:.2f}")
                    table.add_row(*row)
                    Console(stderr=True).print(f"done: {row}")
    Console(width=200).print(table)
    if any(name.removesuffix(SHORTLIST) in CT2_SETTINGS for name, _ in speeds):
        Console(width=200).print(ratio_table(speeds))


if __name__ == "__main__":
    main()
