"""Training speed on Multi30k: target tokens per second by arch and precision, and what bf16 does to the loss.

    python benchmarks/train_speed.py                       # CPU: transformer_small and _base, fp32 and bf16
    python benchmarks/train_speed.py --device cuda --precisions fp32,bf16,fp16 --max-tokens 8192

Speed: a few warm-up updates, then ``--updates`` timed ones through the trainer's own update step
(batches prepared by its prefetch thread, as in training). On a CPU each row also gives the FLOP/s
of its linear layers and output projection (forward and backward) beside the matmul limit: what
torch.matmul reaches at the same shapes in the row's precision (benchmarks/matmul_limit.py); the
share of that limit says how much of an update is spent outside the matrix units. Loss:
``--loss-updates`` updates of ``--loss-arch`` from the same seed in each precision, then the
validation loss (nats per target token; the model is evaluated in the precision it was trained in).

The binarized Multi30k is built in a temporary directory with the preprocess library (joint BPE,
8000 pieces) unless ``--data`` names one. Needs ../shared/data/multi30k beside the repository.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nmt.data.preprocess import PreprocessOptions, preprocess
from nmt.data.vocabulary import PAD_ID
from nmt.device import describe_cpu, resolve_device
from nmt.device_options import DeviceOptions
from nmt.log import setup_logging
from nmt.training.config import TrainConfig
from nmt.training.distributed import DistributedContext
from nmt.training.inputs import check_inputs
from nmt.training.iterator import EpochIterator
from nmt.training.trainer import Trainer, train
from nmt.tuning import bound_onednn_caches

sys.path.insert(0, str(Path(__file__).parent))
from matmul_limit import LinearShapes, training_flops, training_matmul_seconds  # noqa: E402  (a sibling script)

MULTI30K = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))


def build_multi30k(directory: Path, vocab_size: int = 8000) -> str:
    if not MULTI30K.is_dir():
        sys.exit(f"Multi30k not found at {MULTI30K} (set NMT_MULTI30K)")
    options = PreprocessOptions(source_lang="en", target_lang="de", destdir=str(directory / "multi30k"),
                                trainpref=str(MULTI30K / "train"), validpref=str(MULTI30K / "val"),
                                vocab_size=vocab_size, workers=2)
    return str(preprocess(options, show_progress=False).path)


def measure_speed(config: TrainConfig, warmup: int, updates: int, threads: int | None) -> dict[str, float]:
    """Run in a fresh process (see ``measure_in_subprocess``), so that its peak RSS is its own."""
    bound_onednn_caches()  # as `nmt train` does
    if threads:
        torch.set_num_threads(threads)
    setup_logging(quiet=True)
    device = resolve_device(config.compute.device)
    trainer = Trainer(config, DistributedContext(), check_inputs(config, device), device)
    split = trainer.data.for_epoch(1)
    epoch = iter(EpochIterator(split.dataset, split.batches, seed=config.seed, epoch=1,
                               update_freq=config.update_freq, prefetch=config.prefetch,
                               pin_memory=trainer.device.type == "cuda"))
    shapes, first_update = LinearShapes(trainer.model), None
    vocabulary, d_model = trainer.model.output_weight().shape
    tokens = 0.0
    for step in range(warmup + updates):
        if step == warmup:
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started, cpu_started, tokens = time.perf_counter(), time.process_time(), 0.0
            shapes.recording = True
        update = next(epoch)
        if shapes.recording:
            for batch in update.batches:
                shapes.add_projection(int(batch.target.ne(PAD_ID).sum()), d_model, vocabulary)
        step = trainer.train_step(update)
        trainer.state.update += 1
        tokens += step.tokens  # a float: reading it waited for the GPU
        first_update = first_update or (shapes.counts.copy() if shapes.recording else None)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB, before timing matmuls
    flops_per_second = training_flops(shapes.counts) / seconds
    # The limit at one update's shapes (timing every update's would take longer than training them).
    limits = {name: training_flops(first_update) / training_matmul_seconds(first_update, dtype)
              for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))} \
        if trainer.device.type == "cpu" else {}
    memory = torch.cuda.max_memory_allocated() / 2 ** 30 if trainer.device.type == "cuda" else None
    return {"tokens_per_second": tokens / seconds, "tokens_per_cpu_second": tokens / cpu_seconds,
            "seconds_per_update": seconds / updates, "memory": memory,
            "peak_rss": peak_rss,
            "precision": trainer.config.compute.precision, "tflops": flops_per_second / 1e12,
            "limits": {name: limit / 1e12 for name, limit in limits.items()}}


def measure_in_subprocess(*args) -> dict[str, float]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_speed, *args).result()


def limit_cells(result: dict) -> tuple[str, str]:
    """The matmul limit in the precision the run trained in, and the share of it reached."""
    limit = result["limits"].get(result["precision"])
    return ("-", "-") if limit is None else (f"{limit:.3f} TFLOP/s", f"{result['tflops'] / limit:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="binarized Multi30k (default: build one in a temporary directory)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--archs", default="transformer_small,transformer_base")
    parser.add_argument("--precisions", default="auto,fp32,bf16", help="auto shows what it chose here")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    parser.add_argument("--updates", type=int, default=4, help="timed updates per arch and precision")
    parser.add_argument("--repeats", type=int, default=3, help="runs per arch and precision; the median is shown")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 gives steadier "
                        "figures on a machine shared with other jobs")
    parser.add_argument("--loss-arch", default="transformer_small")
    parser.add_argument("--loss-updates", type=int, default=30, help="0: skip the loss comparison")
    parser.add_argument("--loss-max-tokens", type=int, default=1024)
    args = parser.parse_args()
    setup_logging(quiet=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=160)
    console.print(f"command: python {' '.join(sys.argv)}")
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {describe_cpu()}"
                  + (f", GPU {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""))
    with tempfile.TemporaryDirectory(prefix="nmt-train-speed-") as scratch:
        data = args.data or build_multi30k(Path(scratch))
        precisions = args.precisions.split(",")

        speed = Table(title=f"training speed on Multi30k ({args.device}, max_tokens {args.max_tokens}, "
                            f"median of {args.repeats} runs of {args.updates} timed updates)")
        for column in ("arch", "precision", "target tokens/s", "target tokens/CPU-s", "s/update", "vs first row (CPU)",
                       "peak RSS", "peak GPU memory", "matmul TFLOP/s", "matmul limit", "share of limit"):
            speed.add_column(column, justify="left" if column in ("arch", "precision") else "right")
        for arch in args.archs.split(","):
            baseline = None
            for precision in precisions:
                config = TrainConfig(data=data, arch=arch, save_dir=str(Path(scratch) / "unused"),
                                     max_tokens=args.max_tokens, compute=DeviceOptions(args.device, precision))
                runs = sorted((measure_in_subprocess(config, args.warmup, args.updates, args.threads)
                               for _ in range(args.repeats)), key=lambda run: run["tokens_per_cpu_second"])
                result = runs[len(runs) // 2]
                baseline = baseline or result["tokens_per_cpu_second"]
                name = precision if precision == result["precision"] else f"{precision} ({result['precision']})"
                speed.add_row(arch, name, f"{result['tokens_per_second']:,.0f}",
                              f"{result['tokens_per_cpu_second']:,.0f}", f"{result['seconds_per_update']:.2f}",
                              f"{result['tokens_per_cpu_second'] / baseline:.2f}x",
                              f"{max(run['peak_rss'] for run in runs):.2f} GiB",
                              "-" if result["memory"] is None else f"{result['memory']:.2f} GiB",
                              f"{result['tflops']:.3f}", *limit_cells(result))
                console.print(f"  {arch} {name}: {result['tokens_per_second']:,.0f} tok/s, "
                              f"{result['tokens_per_cpu_second']:,.0f} tok/CPU-s, {result['tflops']:.3f} TFLOP/s in "
                              f"matmuls (limit at these shapes: " + ", ".join(
                                  f"{dtype} {limit:.3f}" for dtype, limit in result["limits"].items()) + ")")
        console.print(speed)

        if args.loss_updates:
            loss = Table(title=f"validation loss after {args.loss_updates} updates of {args.loss_arch} "
                               f"(max_tokens {args.loss_max_tokens}, peak lr 1e-3, 10 warm-up updates, seed 1)")
            for column in ("precision", "valid loss", "valid ppl", "wall clock"):
                loss.add_column(column, justify="left" if column == "precision" else "right")
            for precision in precisions:
                config = TrainConfig(data=data, arch=args.loss_arch, save_dir=str(Path(scratch) / f"loss-{precision}"),
                                     max_tokens=args.loss_max_tokens, compute=DeviceOptions(args.device, precision),
                                     lr=1e-3, warmup_updates=10, max_update=args.loss_updates,
                                     log_interval=10 ** 9)
                summary = train(config)
                loss.add_row(precision, f"{summary.valid_loss:.3f}", f"{summary.valid_ppl:.1f}",
                             f"{summary.seconds:.0f} s")
            console.print(loss)


if __name__ == "__main__":
    main()
