"""Speed of `nmt generate` (beam 4) on the Multi30k test set: fp32, bf16 and int8, 1 and 2 threads.

    python benchmarks/generate_speed.py [--path CKPT [--reference REF]] [--data DIR] [--limit N]

With --path, the checkpoint translates test_2016_flickr.en and its own max length rule applies
(a * |source| + b, defaults 1 and 50). Without it, a randomly initialised transformer_small (joint
BPE vocabulary of --vocab-size pieces trained on Multi30k train) stands in: a random model never
chooses EOS, so every hypothesis runs to the max length, which is capped at |source| + 2 tokens
(about the length of a German reference) to keep the timing comparable with a trained model's.
With --reference (the raw German test side), the table also gives BLEU per precision, the cost of
bf16 and int8. Sentences/s and tokens/s (output tokens of the best hypothesis, EOS included) are
wall time over the whole set, model loading excluded; each figure is the best of --repeats runs.

With CTranslate2 installed (pip install 'nmt[ct2]'), the settings ct2-float32 and ct2-int8 decode
the same model exported by `nmt export ctranslate2`, through the function behind `nmt generate
--engine ctranslate2` (same batches, beam, max length, threads; fairseq's length penalty with the
same alpha, as CTranslate2 has no other), and a second table gives the ratios nmt / CTranslate2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from nmt.checkpoint import Vocabularies, model_state, save_checkpoint
from nmt.data.vocabulary import EOS_ID, PAD_ID, Vocabulary
from nmt.files import read_lines
from nmt.generation.generator import GenerateOptions, prepare_model, translate_ids
from nmt.options import build
from nmt.models.registry import build_model, get_arch
from nmt.scoring import score

DEFAULT_DATA = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))
SETTINGS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "int8": ("fp32", "int8")}  # (precision, quantize)
CT2_SETTINGS = {"ct2-float32": "float32", "ct2-int8": "int8"}  # the weight type the export stores
HAVE_CT2 = importlib.util.find_spec("ctranslate2") is not None


@dataclass
class Run:
    seconds: float
    outputs: list[list[int]]


def random_checkpoint(data: Path, vocab_size: int, directory: Path) -> Path:
    """A randomly initialised transformer_small over a joint BPE vocabulary of Multi30k train."""
    text = read_lines(data / "train.en.gz") + read_lines(data / "train.de.gz")
    vocab = Vocabulary.train(text, vocab_size=vocab_size)
    arch = get_arch("transformer_small")
    torch.manual_seed(1)
    model = build_model(arch.model_name, arch.config, len(vocab), len(vocab), PAD_ID)
    path = directory / "random_transformer_small.pt"
    save_checkpoint(path, model_state(model, arch.name, arch.config, Vocabularies("en", "de", vocab, vocab)))
    return path


def time_translation(path: Path, lines: list[str], options: GenerateOptions, threads: int, repeats: int) -> Run:
    torch.set_num_threads(threads)
    model, vocabs = prepare_model(path, torch.device("cpu"), options.quantize)
    sources = [np.asarray(ids + [EOS_ID], dtype=np.int64) for ids in vocabs.source.encode_batch(lines)]
    translate_ids(model, sources[:32], options.search, options.batching, precision=options.precision)  # warm-up
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        hypotheses = translate_ids(model, sources, options.search, options.batching, precision=options.precision)
        seconds = time.perf_counter() - start
        if best is None or seconds < best.seconds:
            best = Run(seconds, [hyps[0].tokens for hyps in hypotheses])
    return best


def time_ctranslate2(path: Path, lines: list[str], options: GenerateOptions, threads: int, repeats: int,
                     quantization: str, workdir: Path) -> Run:
    """The model exported to CTranslate2 (once per weight type), decoded as `--engine ctranslate2` does."""
    from nmt.export.ctranslate2 import ExportOptions, export_ctranslate2
    from nmt.generation.ctranslate2_engine import open_translator, translate_ids_ctranslate2

    directory = workdir / f"ct2-{quantization}"
    if not directory.exists():
        export_ctranslate2(ExportOptions(str(path), str(directory), quantization))
    torch.set_num_threads(threads)  # CTranslate2 gets torch's thread count
    translator, vocabs = open_translator(directory, torch.device("cpu"), "default")
    options = dataclasses.replace(options, search=dataclasses.replace(options.search, lenpen_style="fairseq"))
    sources = [np.asarray(ids + [EOS_ID], dtype=np.int64) for ids in vocabs.source.encode_batch(lines)]
    translate_ids_ctranslate2(translator, vocabs, sources[:32], options)  # warm-up
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        hypotheses = translate_ids_ctranslate2(translator, vocabs, sources, options)
        seconds = time.perf_counter() - start
        if best is None or seconds < best.seconds:
            best = Run(seconds, [hyps[0].tokens for hyps in hypotheses])
    return best


def ratio_table(speeds: dict[tuple[str, int], float]) -> Table:
    """nmt / CTranslate2 sentences/s per thread count: float32 against float32, fastest against fastest."""
    table = Table(title="nmt / CTranslate2 (sentences/s ratio, same threads)")
    for column in ("threads", "fp32 / ct2-float32", "nmt fastest / ct2 fastest"):
        table.add_column(column, justify="right")
    for threads in sorted({t for _, t in speeds}):
        ours = {name: v for (name, t), v in speeds.items() if t == threads and name in SETTINGS}
        theirs = {name: v for (name, t), v in speeds.items() if t == threads and name in CT2_SETTINGS}
        if not ours or not theirs:
            continue
        same_type = ours["fp32"] / theirs["ct2-float32"] if "fp32" in ours and "ct2-float32" in theirs else None
        fastest = f"{max(ours.values()) / max(theirs.values()):.2f}x ({max(ours, key=ours.get)} / " \
                  f"{max(theirs, key=theirs.get)})"
        table.add_row(str(threads), "n/a" if same_type is None else f"{same_type:.2f}x", fastest)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="a trained checkpoint (default: random transformer_small)")
    parser.add_argument("--reference", type=Path, help="raw reference translations, for BLEU per precision")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--limit", type=int, default=0, help="translate only the first N test sentences")
    parser.add_argument("--vocab-size", type=int, default=10000, help="vocabulary of the random model")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8000)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--settings", default="fp32,bf16,int8" + (",ct2-float32,ct2-int8" if HAVE_CT2 else ""),
                        help="comma-separated, from fp32, bf16, int8, ct2-float32, ct2-int8")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    test_file = args.data / "test_2016_flickr.en.gz"
    if not test_file.exists():
        raise SystemExit(f"Multi30k not found in {args.data} (set --data or NMT_MULTI30K)")
    if args.reference and not args.path:
        raise SystemExit("--reference needs --path: BLEU of a random model means nothing")
    lines = read_lines(test_file)[: args.limit or None]
    references = read_lines(args.reference)[: len(lines)] if args.reference else None

    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or random_checkpoint(args.data, args.vocab_size, Path(tmp))
        model_name = str(args.path) if args.path else f"random transformer_small, vocab {args.vocab_size}"
        length_rule = dict(max_len_a=1.0, max_len_b=50) if args.path else dict(max_len_a=1.0, max_len_b=2)
        table = Table(title=f"nmt generate, beam {args.beam}, Multi30k test_2016_flickr ({len(lines):,} sentences), "
                            f"{model_name}, max length {length_rule['max_len_a']:g}*src+{length_rule['max_len_b']}, "
                            f"{os.cpu_count()} CPU cores, torch {torch.__version__}")
        columns = ["precision", "threads", "seconds", "sentences/s", "tokens/s", "same output as fp32"]
        for column in columns + (["BLEU"] if references else []):
            table.add_column(column, justify="right")
        fp32_outputs = None  # of the first fp32 run
        speeds: dict[tuple[str, int], float] = {}  # (setting, threads) -> sentences/s
        for threads in (int(t) for t in args.threads.split(",")):
            for name in args.settings.split(","):
                precision, quantize = ("fp32", "none") if name in CT2_SETTINGS else SETTINGS[name]
                options = build(GenerateOptions, dict(input="-", beam=args.beam, max_tokens=args.max_tokens,
                                                      precision=precision, quantize=quantize, **length_rule))
                if name in CT2_SETTINGS:
                    run = time_ctranslate2(Path(path), lines, options, threads, args.repeats, CT2_SETTINGS[name],
                                           Path(tmp))
                else:
                    run = time_translation(Path(path), lines, options, threads, args.repeats)
                speeds[name, threads] = len(lines) / run.seconds
                fp32_outputs = fp32_outputs or (run.outputs if name == "fp32" else None)
                tokens = sum(len(tokens) for tokens in run.outputs)
                same = "n/a" if fp32_outputs is None else \
                    f"{sum(a == b for a, b in zip(run.outputs, fp32_outputs)) / len(lines):.0%}"
                row = [name, str(threads), f"{run.seconds:.1f}", f"{len(lines) / run.seconds:,.1f}",
                       f"{tokens / run.seconds:,.0f}", same]
                if references:
                    _, vocabs = prepare_model(path, torch.device("cpu"), "none")
                    row.append(f"{score([vocabs.target.decode(t) for t in run.outputs], [references])[0].score:.2f}")
                table.add_row(*row)
                Console(stderr=True).print(f"done: {row}")
    Console().print(table)
    if any(name in CT2_SETTINGS for name, _ in speeds):
        Console().print(ratio_table(speeds))


if __name__ == "__main__":
    main()
