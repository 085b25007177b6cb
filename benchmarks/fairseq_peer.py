"""nmt beside fairseq on the same text, vocabulary, model shape, batch size and threads.

    python benchmarks/fairseq_peer.py --fairseq-bin /path/to/fairseq-env/bin train --updates 20
    python benchmarks/fairseq_peer.py --fairseq-bin /path/to/fairseq-env/bin preprocess --copies 10

fairseq is not a dependency of nmt and is never vendored: install it in its own environment
(docs/performance.md, "fairseq as a peer", says how fairseq 0.12.2 runs on Python 3.11) and name
its ``bin`` directory. Both toolkits get Multi30k encoded by the same sentencepiece model (joint
BPE, --vocab-size pieces; fairseq's dictionary is written from that model, so both softmaxes have
the same rows).

train: ``fairseq-train`` (transformer, 3+3 layers, d_model 256, ffn 1024, 4 heads, all embeddings
shared, label smoothing 0.1, Adam, inverse-sqrt warm-up: transformer_small) and nmt's trainer,
each for --updates updates of --max-tokens batches with --threads threads; target tokens per
second over the updates after the first --warmup (fairseq: its ``wps`` per update; nmt:
benchmarks/train_speed.py's measurement), and peak RSS of each process.

preprocess: Multi30k's training set repeated --copies times; nmt's whole command (``nmt
preprocess``: sentencepiece training, encoding, binarizing) against fairseq's pipeline (the
same sentencepiece training, then encoding to text, then ``fairseq-preprocess``), each with
--workers processes; wall time of each step and peak RSS.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sentencepiece
from rich.console import Console
from rich.table import Table

from nmt.data.vocabulary import Vocabulary
from nmt.device import describe_cpu
from nmt.device_options import DeviceOptions
from nmt.training.config import TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from train_speed import MULTI30K, build_multi30k, measure_in_subprocess  # noqa: E402  (a sibling script)

SHAPE = ["--arch", "transformer", "--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256",
         "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings",
         "--dropout", "0.3", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
         "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-9", "--lr", "1.5e-3",
         "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "800"]


def measured(command: list[str], environment: dict[str, str] | None = None, **kwargs) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MB) of the child and what it printed (stdout + stderr)."""
    wrapped = ["/usr/bin/time", "-f", "PEAK_RSS_KB %M", *command]
    started = time.perf_counter()
    result = subprocess.run(wrapped, capture_output=True, text=True, env={**os.environ, **(environment or {})},
                            **kwargs)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")
    peak = [line for line in result.stderr.splitlines() if line.startswith("PEAK_RSS_KB")][-1]
    return seconds, int(peak.split()[1]) / 1024, result.stdout + result.stderr


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()


def write_pieces(processor: sentencepiece.SentencePieceProcessor, lines: list[str], path: Path,
                 threads: int = 1) -> None:
    """The text as space-separated pieces: what fairseq-preprocess reads."""
    pieces = processor.encode(lines, out_type=str, num_threads=threads)
    path.write_text("".join(" ".join(sentence) + "\n" for sentence in pieces), encoding="utf-8")


def write_fairseq_dictionary(vocab: Vocabulary, path: Path) -> None:
    """Every ordinary piece of the sentencepiece model (fairseq adds its own <s> <pad> </s> <unk>)."""
    processor = vocab.processor
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())
              if not (processor.is_control(i) or processor.is_unknown(i))]
    path.write_text("".join(f"{piece} 1\n" for piece in pieces), encoding="utf-8")


def fairseq_data(fairseq_bin: Path, vocab: Vocabulary, work: Path) -> Path:
    for split, prefix in (("train", "train"), ("valid", "val")):
        for lang in ("en", "de"):
            write_pieces(vocab.processor, read_gz(MULTI30K / f"{prefix}.{lang}.gz"), work / f"{split}.{lang}")
    write_fairseq_dictionary(vocab, work / "dict.txt")
    destdir = work / "fairseq-bin"
    measured([str(fairseq_bin / "fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
              "--trainpref", str(work / "train"), "--validpref", str(work / "valid"), "--destdir", str(destdir),
              "--srcdict", str(work / "dict.txt"), "--joined-dictionary", "--workers", "1"])
    return destdir


def fairseq_train(fairseq_bin: Path, data: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    seconds, peak, output = measured(
        [str(fairseq_bin / "fairseq-train"), str(data), *SHAPE, "--max-tokens", str(args.max_tokens), "--cpu",
         "--max-update", str(args.warmup + args.updates), "--disable-validation", "--no-save", "--num-workers", "0",
         "--save-dir", str(work / "fairseq-checkpoints"), "--log-format", "json", "--log-interval", "1",
         "--seed", "1"], {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}, cwd=work)
    records = [json.loads(line[line.index("{"):]) for line in output.splitlines()
               if '"wps"' in line and '"num_updates"' in line and "train_inner" in line]
    timed = [record for record in records if int(record["num_updates"]) > args.warmup]
    if not timed:
        sys.exit(f"no per-update wps in fairseq's log:\n{output[-3000:]}")
    return {"tokens_per_second": statistics.median(float(r["wps"]) for r in timed), "peak_rss": peak}


def nmt_train(data: Path, args: argparse.Namespace) -> dict[str, float]:
    config = TrainConfig(data=str(data), arch="transformer_small", save_dir=str(data / "unused"),
                         max_tokens=args.max_tokens, compute=DeviceOptions(precision=args.precision), lr=1.5e-3,
                         warmup_updates=800)
    run = measure_in_subprocess(config, args.warmup, args.updates, args.threads)
    return {"tokens_per_second": run["tokens_per_second"], "peak_rss": run["peak_rss"] * 1024,
            "precision": run["precision"]}


def compare_training(args: argparse.Namespace, console: Console) -> None:
    with tempfile.TemporaryDirectory(prefix="nmt-fairseq-") as scratch:
        work = Path(scratch)
        nmt_data = Path(build_multi30k(work, args.vocab_size))
        vocab = Vocabulary.load(nmt_data / "spm.model")
        fairseq_bin_data = fairseq_data(args.fairseq_bin, vocab, work)
        table = Table(title=f"training, transformer_small shape, Multi30k, max_tokens {args.max_tokens}, "
                            f"{args.threads} thread(s), {args.updates} timed updates after {args.warmup}")
        for column in ("toolkit", "precision", "target tokens/s", "vs fairseq", "peak RSS (MB)"):
            table.add_column(column, justify="left" if column in ("toolkit", "precision") else "right")
        rounds = [(fairseq_train(args.fairseq_bin, fairseq_bin_data, work, args), nmt_train(nmt_data, args))
                  for _ in range(args.repeats)]
        fairseq_speed = statistics.median(f["tokens_per_second"] for f, _ in rounds)
        nmt_speed = statistics.median(n["tokens_per_second"] for _, n in rounds)
        table.add_row("fairseq 0.12.2", "fp32", f"{fairseq_speed:,.0f}", "1.00x",
                      f"{max(f['peak_rss'] for f, _ in rounds):,.0f}")
        table.add_row("nmt", rounds[0][1]["precision"], f"{nmt_speed:,.0f}", f"{nmt_speed / fairseq_speed:.2f}x",
                      f"{max(n['peak_rss'] for _, n in rounds):,.0f}")
        console.print(table)
        console.print("rounds (fairseq, nmt tokens/s): " + ", ".join(
            f"({f['tokens_per_second']:,.0f}, {n['tokens_per_second']:,.0f})" for f, n in rounds))


def train_spm(prefix: str, model_prefix: str, vocab_size: str, threads: str) -> None:
    """fairseq's side, step 1: sentencepiece trained as nmt trains it (joint BPE, byte fallback)."""
    sentencepiece.SentencePieceTrainer.train(
        input=[f"{prefix}.en", f"{prefix}.de"], model_prefix=model_prefix, vocab_size=int(vocab_size),
        model_type="bpe", character_coverage=1.0, byte_fallback=True, input_sentence_size=10_000_000,
        shuffle_input_sentence=True, num_threads=int(threads), minloglevel=2)


def encode_spm(model: str, prefix: str, output: str, threads: str) -> None:
    """fairseq's side, step 2: both sides encoded to pieces."""
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    for lang in ("en", "de"):
        write_pieces(processor, Path(f"{prefix}.{lang}").read_text(encoding="utf-8").splitlines(),
                     Path(f"{output}.{lang}"), int(threads))


def preprocess_rows(work: Path, workers: int, vocab_size: int,
                    fairseq_bin: Path) -> list[tuple[str, str, float, float]]:
    """(toolkit, step, seconds, peak RSS MB) of nmt's whole command and of each step of fairseq's pipeline."""
    nmt_seconds, nmt_peak, _ = measured(
        [sys.executable, "-m", "nmt", "preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref",
         str(work / "train"), "--destdir", str(work / f"nmt-bin-{workers}"), "--vocab-size", str(vocab_size),
         "--workers", str(workers), "--quiet"])
    rows = [("nmt", "whole command", nmt_seconds, nmt_peak)]
    this = [sys.executable, __file__, "step"]
    steps = {
        "sentencepiece training": [*this, "train_spm", str(work / "train"), str(work / "spm"), str(vocab_size),
                                   str(workers)],
        "encoding to text": [*this, "encode_spm", str(work / "spm.model"), str(work / "train"), str(work / "pieces"),
                             str(workers)],
        "fairseq-preprocess": [str(fairseq_bin / "fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
                               "--trainpref", str(work / "pieces"), "--destdir", str(work / f"fairseq-bin-{workers}"),
                               "--joined-dictionary", "--workers", str(workers)],
    }
    for step, command in steps.items():
        seconds, peak, _ = measured(command)
        rows.append(("fairseq", step, seconds, peak))
    return rows


def compare_preprocessing(args: argparse.Namespace, console: Console) -> None:
    with tempfile.TemporaryDirectory(prefix="nmt-fairseq-") as scratch:
        work = Path(scratch)
        for lang in ("en", "de"):
            text = "".join(line + "\n" for line in read_gz(MULTI30K / f"train.{lang}.gz"))
            (work / f"train.{lang}").write_text(text * args.copies, encoding="utf-8")
        pairs = 29_000 * args.copies
        table = Table(title=f"preprocess, Multi30k train x {args.copies} ({pairs:,} pairs), "
                            f"vocabulary {args.vocab_size}")
        for column in ("workers", "toolkit", "step", "seconds", "pairs/s", "peak RSS (MB)"):
            table.add_column(column, justify="left" if column in ("toolkit", "step") else "right")
        summary = []
        for workers in (int(item) for item in args.workers.split(",")):
            rows = preprocess_rows(work, workers, args.vocab_size, args.fairseq_bin)
            for toolkit, step, seconds, peak in rows:
                table.add_row(str(workers), toolkit, step, f"{seconds:.1f}", f"{pairs / seconds:,.0f}", f"{peak:,.0f}")
            nmt, pipeline, alone = rows[0][2], sum(row[2] for row in rows[1:]), rows[-1][2]
            table.add_row(str(workers), "fairseq", "pipeline", f"{pipeline:.1f}", f"{pairs / pipeline:,.0f}",
                          f"{max(row[3] for row in rows[1:]):,.0f}")
            summary.append(f"{workers} worker(s): nmt {pipeline / nmt:.2f}x fairseq's pipeline, "
                           f"{alone / nmt:.2f}x fairseq-preprocess alone")
        console.print(table)
        console.print("\n".join(summary))


def main() -> None:
    if sys.argv[1:2] == ["step"]:  # one step of fairseq's pipeline, in a child process of its own
        {"train_spm": train_spm, "encode_spm": encode_spm}[sys.argv[2]](*sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fairseq-bin", type=Path, required=True, help="the bin directory of a fairseq environment")
    parser.add_argument("--vocab-size", type=int, default=8000)
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train")
    train.add_argument("--max-tokens", type=int, default=4096)
    train.add_argument("--threads", type=int, default=1)
    train.add_argument("--warmup", type=int, default=3)
    train.add_argument("--updates", type=int, default=20)
    train.add_argument("--repeats", type=int, default=1, help="alternating fairseq and nmt runs; medians shown")
    train.add_argument("--precision", default="auto", help="nmt's precision (fairseq on a CPU: fp32)")
    prep = sub.add_parser("preprocess")
    prep.add_argument("--copies", type=int, default=10)
    prep.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    args = parser.parse_args()
    if not (MULTI30K / "train.en.gz").exists():
        sys.exit(f"Multi30k not found at {MULTI30K} (set NMT_MULTI30K)")
    if not (args.fairseq_bin / "fairseq-train").exists():
        sys.exit(f"no fairseq-train in {args.fairseq_bin}")
    console = Console(width=160)
    console.print(f"command: python {' '.join(sys.argv)}")
    console.print(describe_cpu())
    (compare_training if args.what == "train" else compare_preprocessing)(args, console)


if __name__ == "__main__":
    main()
