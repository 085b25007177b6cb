"""Throughput of `nmt preprocess` on the Multi30k training set with 1 and 2 workers.

    python benchmarks/preprocess.py [--data DIR] [--vocab-size 10000] [--repeats 3]

Prints a table of lines/s (sentence pairs per second of wall time) for the whole command on the
train split (sentencepiece training, then reading + checking + encoding + writing in chunks), and
for the streamed reading, checking and encoding alone (both sides; --workers sentencepiece threads encode).
Each figure is the best of --repeats runs. benchmarks/scale.py measures larger corpora.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nmt.data.binarize import encoded_chunks
from nmt.data.corpus import SplitFiles, find_splits
from nmt.data.preprocess import CHUNK_LINES, PreprocessOptions, preprocess
from nmt.data.vocabulary import Vocabulary
from nmt.files import read_lines

DEFAULT_DATA = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))


def best_time(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with train.{en,de}[.gz]")
    parser.add_argument("--vocab-size", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not (args.data / "train.en.gz").exists() and not (args.data / "train.en").exists():
        raise SystemExit(f"Multi30k not found in {args.data} (set --data or NMT_MULTI30K)")

    split: SplitFiles = find_splits("en", "de", str(args.data / "train"), None, None)[0]
    pairs = len(read_lines(split.source))
    table = Table(title=f"nmt preprocess, Multi30k train ({pairs:,} pairs), vocab {args.vocab_size}, "
                        f"best of {args.repeats}, {os.cpu_count()} CPU cores")
    for column in ("workers", "whole command (s)", "pairs/s", "read+check+encode (s)", "encoded lines/s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        vocab = None
        for workers in (1, 2):
            options = PreprocessOptions(source_lang="en", target_lang="de", destdir=f"{tmp}/bin",
                                        trainpref=str(args.data / "train"), vocab_size=args.vocab_size,
                                        workers=workers, force=True)
            whole = best_time(lambda: preprocess(options, show_progress=False), args.repeats)
            vocab = vocab or Vocabulary.load(f"{tmp}/bin/spm.model")
            encode = best_time(lambda: list(encoded_chunks(split, (vocab, vocab), workers, CHUNK_LINES)), args.repeats)
            table.add_row(str(workers), f"{whole:.2f}", f"{pairs / whole:,.0f}", f"{encode:.2f}",
                          f"{2 * pairs / encode:,.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
