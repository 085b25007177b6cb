"""Preprocess and training start-up as the corpus grows: Multi30k repeated N times.

    python benchmarks/scale.py                                   # 1x and 10x; workers 1 and 2
    python benchmarks/scale.py --repeats 1,10,100 --startup-repeats 1,10,100,1241

Preprocess: ``nmt preprocess`` (the real command, in a child process) on Multi30k's training set
written N times (29,000 x N pairs, plain text; joint BPE, --vocab-size), with each --workers value.
Training start-up: open the data directory, build the length-bucketed batch list, compose epoch
1's batches and take the first update (transformer_tiny, so the model's share stays small),
in a child process; sizes not preprocessed here are made by tiling the 1x data directory's
arrays (the same sentences N times), which is what start-up cost depends on.

Each row: wall time, CPU time (user + sys, all processes), pairs per second of wall time, and peak
resident memory of the largest process (ru_maxrss; with --workers 2 each encoding process holds
the sentencepiece model and a chunk or two of text, far less than the main process).
Needs ../shared/data/multi30k beside the repository (or --data / NMT_MULTI30K).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

DEFAULT_DATA = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))
BASE_PAIRS = 29_000


def run_measured(command: list[str], environment: dict[str, str] | None = None) -> dict[str, float]:
    """Wall time, CPU time and peak RSS (MB) of a child process and the processes it waited for."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    output, errors = process.stdout.read().decode(), process.stderr.read().decode()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{errors}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
            "stdout": output}


def write_corpus(data: Path, directory: Path, repeats: int) -> str:
    """train.{en,de}: Multi30k's training set ``repeats`` times, plain text."""
    import gzip

    directory.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        text = gzip.decompress((data / f"train.{lang}.gz").read_bytes())
        with open(directory / f"train.{lang}", "wb") as handle:
            for _ in range(repeats):
                handle.write(text)
    return str(directory / "train")


def tile_data_dir(source: Path, destination: Path, times: int) -> None:
    """A data directory whose train split is ``source``'s ``times`` over (written side by side, not in memory)."""
    from nmt.data.dataset import DataDir
    from nmt.data.meta import SplitMeta
    from nmt.data.token_file import TokenFileWriter

    data = DataDir.open(source)
    destination.mkdir(parents=True, exist_ok=True)
    for name in data.meta.vocab_files.values():
        (destination / name).write_bytes((source / name).read_bytes())
    for lang in (data.source_lang, data.target_lang):
        tokens = np.load(source / f"train.{lang}.tokens.npy")
        sizes = np.diff(np.load(source / f"train.{lang}.offsets.npy"))
        writer = TokenFileWriter(destination / f"train.{lang}", tokens.dtype)
        for _ in range(times):
            writer.append(tokens, sizes)
        writer.close()
    splits = {"train": SplitMeta(sentences=len(data.split("train")) * times)}
    dataclasses.replace(data.meta, splits=splits).save(destination)


def startup(data_dir: str, max_tokens: int) -> dict[str, float]:
    """In this process: open the data dir -> batch list -> epoch 1's batches -> first update."""
    import resource

    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it: seconds, whatever the corpus)

    from nmt.data.dataset import DataDir
    from nmt.training.config import load_train_config
    from nmt.training.distributed import DistributedContext
    from nmt.training.inputs import check_inputs
    from nmt.training.iterator import EpochIterator, TrainingBatches
    from nmt.training.trainer import Trainer

    def memory_mb(field: str) -> float:  # VmRSS: now; VmHWM: the peak so far
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1024

    torch.set_num_threads(1)  # the model step's time is not the subject; keep it out of the other processes' way
    baseline = memory_mb("VmRSS")  # torch and nmt imported
    with tempfile.TemporaryDirectory() as save_dir:
        config = load_train_config({"data": data_dir, "arch": "transformer_tiny", "max_tokens": max_tokens,
                                    "save_dir": save_dir, "device": "cpu", "prefetch": 0})
        started = time.perf_counter()
        train_set = DataDir.open(data_dir).split("train")
        TrainingBatches(train_set, max_tokens, required_multiple=config.required_batch_size_multiple)
        data_ready = time.perf_counter()  # what the trainer does first, timed alone
        data_peak = memory_mb("VmHWM")
        device = torch.device("cpu")  # the same again (check_inputs), and the model and optimizer
        trainer = Trainer(config, DistributedContext(), check_inputs(config, device), device)
        built = time.perf_counter()
        split = trainer.data.for_epoch(1)
        updates = iter(EpochIterator(split.dataset, split.batches, seed=config.seed, epoch=1, prefetch=0))
        first = next(updates)
        composed = time.perf_counter()
        trainer.train_step(first)
        done = time.perf_counter()
    return {"pairs": len(split.dataset), "batches": len(split.batches),
            "open_and_batch_list": data_ready - started, "epoch_batches": composed - built,
            "first_update": done - composed, "total": done - data_ready,  # the trainer: open -> first update
            "baseline_mb": baseline, "data_peak_mb": data_peak,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with train.{en,de}.gz")
    parser.add_argument("--repeats", default="1,10", help="corpus sizes to preprocess, in copies of Multi30k")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--startup-repeats", default="1,10,100", help="corpus sizes for the training start-up")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--compare", metavar="NMT_TREE",
                        help="also run the preprocess rows with the nmt package in this source tree (e.g. an older "
                             "commit's `git archive`), on the same corpora")
    parser.add_argument("--startup", metavar="DATA_DIR", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.startup:
        print(json.dumps(startup(args.startup, args.max_tokens)))
        return
    if not (args.data / "train.en.gz").exists():
        sys.exit(f"Multi30k not found in {args.data} (set --data or NMT_MULTI30K)")
    repeats = [int(n) for n in args.repeats.split(",")]
    workers = [int(n) for n in args.workers.split(",")]
    console = Console(width=200)  # whole column headers, also when piped
    nmt = [sys.executable, "-m", "nmt"]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        table = Table(title=f"nmt preprocess: Multi30k train x N, joint BPE {args.vocab_size}, "
                            f"{os.cpu_count()} CPU cores")
        for column in ("copies", "pairs", "nmt", "sentencepiece", "workers", "wall (s)", "CPU (s)", "pairs/s",
                       "peak RSS (MB)"):
            table.add_column(column, justify="right")
        trees = [("this", None)] + ([("compared", args.compare)] if args.compare else [])
        for copies in repeats:
            prefix = write_corpus(args.data, Path(tmp) / f"x{copies}", copies)
            model = f"{tmp}/x1/bin-{workers[0]}/spm.model"  # trained on the 1x corpus: encoding alone
            runs = [(tree, path, "trained", count) for tree, path in trees for count in workers]
            runs += [("this", None, "reused", count) for count in workers]
            for tree, path, spm_model, count in runs:
                destdir = f"{tmp}/x{copies}/bin-{count}" if (tree, spm_model) == ("this", "trained") else f"{tmp}/other"
                reuse = ["--spm-model", model] if spm_model == "reused" else []
                environment = None if path is None else {**os.environ, "PYTHONPATH": path}
                figures = run_measured([*nmt, "preprocess", "-s", "en", "-t", "de", "--trainpref", prefix,
                                        "--destdir", destdir, "--vocab-size", str(args.vocab_size), *reuse,
                                        "--workers", str(count), "--quiet", "--force"], environment)
                pairs = BASE_PAIRS * copies
                table.add_row(str(copies), f"{pairs:,}", tree, spm_model, str(count), f"{figures['wall']:.1f}",
                              f"{figures['cpu']:.1f}", f"{pairs / figures['wall']:,.0f}", f"{figures['rss_mb']:,.0f}")
                console.print(f"x{copies}, {tree}, spm {spm_model}, {count} worker(s): {figures['wall']:.1f} s",
                              style="dim")
            for path in Path(prefix).parent.glob("train.*"):
                path.unlink()  # the text is no longer needed
        console.print(table)

        table = Table(title=f"training start-up: open data dir -> first update (transformer_tiny, --max-tokens "
                            f"{args.max_tokens}, CPU)")
        for column in ("copies", "pairs", "batches", "open + batch list (s)", "epoch 1 batches (s)",
                       "first update (s)", "open -> first update (s)", "RSS after imports (MB)",
                       "peak RSS, data (MB)", "peak RSS (MB)"):
            table.add_column(column, justify="right")
        base = Path(tmp) / "x1" / f"bin-{workers[0]}"
        for copies in [int(n) for n in args.startup_repeats.split(",")]:
            data_dir = Path(tmp) / f"x{copies}" / f"bin-{workers[0]}"
            if not data_dir.exists():
                data_dir = Path(tmp) / f"tiled{copies}"
                tile_data_dir(base, data_dir, copies)
            child = run_measured([sys.executable, __file__, "--startup", str(data_dir),
                                  "--max-tokens", str(args.max_tokens)])
            figures = json.loads(child["stdout"].strip().splitlines()[-1])
            table.add_row(str(copies), f"{figures['pairs']:,}", f"{figures['batches']:,}",
                          f"{figures['open_and_batch_list']:.2f}", f"{figures['epoch_batches']:.2f}",
                          f"{figures['first_update']:.2f}", f"{figures['total']:.2f}",
                          f"{figures['baseline_mb']:,.0f}", f"{figures['data_peak_mb']:,.0f}",
                          f"{figures['peak_mb']:,.0f}")
            if data_dir.name.startswith("tiled"):
                for path in data_dir.iterdir():
                    path.unlink()
        console.print(table)


if __name__ == "__main__":
    main()
