"""Lexical constraints, target prefixes and banned phrases on Multi30k test_2016_flickr: do the
constraints appear, what they do to BLEU, and what each control costs in speed.

    python benchmarks/constraints.py --path CKPT [--data DIR] [--beam 5] [--limit N] [--threads 1]

Constraints follow Post & Vilar (2018): for each sentence, 1 to 3 phrases of 1 to 3 words drawn at
random (non-overlapping, seed --seed) from its reference. Coverage is the share of the sentences
whose constraints fit their max length (all of them, at the default a=1, b=50) whose best
translation contains every constraint's pieces. The prefix row forces the reference's first 1 to
3 words (drawn with the same seed); the ban row bans --bans two-word phrases drawn from the
training references that no test reference contains (the row measures the cost of checking them). Each
row translates the whole set through the Python API (``Translator.hypotheses``) at the same beam;
sentences/s and this process's CPU seconds are the median of --repeats runs (CPU seconds are the
steadier figure on a machine shared with other jobs). BLEU is sacrebleu's, against the raw reference.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nmt import Translator
from nmt.device import describe_cpu
from nmt.files import read_lines
from nmt.generation.constraints import contains
from nmt.generation.control_input import controls_from_lists
from nmt.generation.inference import check_controls, encode_sources
from nmt.generation.search import model_positions
from nmt.scoring import MetricOptions, score

DEFAULT_DATA = Path(os.environ.get("NMT_MULTI30K", Path(__file__).resolve().parents[2] / "shared/data/multi30k"))


def reference_phrases(reference: str, rng: random.Random) -> list[str]:
    """1 to 3 non-overlapping phrases of 1 to 3 words of the reference (Post & Vilar's protocol)."""
    words = reference.split()
    taken: set[int] = set()
    phrases = []
    for _ in range(rng.randint(1, 3)):
        length = rng.randint(1, min(3, len(words)))
        start = rng.randrange(len(words) - length + 1)
        span = set(range(start, start + length))
        if not span & taken:
            taken |= span
            phrases.append(" ".join(words[start:start + length]))
    return phrases


def reference_prefix(reference: str, rng: random.Random) -> str:
    return " ".join(reference.split()[: rng.randint(1, 3)])


def ban_phrases(data: Path, count: int, references: list[str], rng: random.Random) -> list[str]:
    """``count`` two-word phrases of the training references that no test reference contains."""
    lines = [words for words in (line.split() for line in read_lines(data / "train.de.gz")) if len(words) >= 2]
    phrases: list[str] = []
    while len(phrases) < count:
        words = rng.choice(lines)
        start = rng.randrange(len(words) - 1)
        phrase = " ".join(words[start:start + 2])
        if phrase not in phrases and not any(phrase in reference for reference in references):
            phrases.append(phrase)
    return phrases


def timed(run, repeats: int):
    """The result and (wall, CPU) seconds of the median of ``repeats`` runs."""
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = run()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu, result))
    runs.sort(key=lambda r: r[0])
    return runs[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="a trained Multi30k en-de checkpoint")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with Multi30k's .gz files")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--limit", type=int, default=0, help="only the first N test sentences")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bans", type=int, default=20, help="banned phrases in the ban row")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sources = read_lines(args.data / "test_2016_flickr.en.gz")
    references = read_lines(args.data / "test_2016_flickr.de.gz")
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    rng = random.Random(args.seed)
    constraints = [reference_phrases(r, rng) for r in references]
    prefixes = [reference_prefix(r, rng) for r in references]
    bans = ban_phrases(args.data, args.bans, references, rng)

    translator = Translator.from_checkpoint(args.path, device="cpu", precision="fp32")
    target = translator.vocabs.target
    search, _ = translator.options(beam=args.beam)
    fitted = check_controls(encode_sources(translator.vocabs, sources),
                            controls_from_lists(target, len(sources), constraints=constraints), search,
                            model_positions(translator.model))
    fit = [bool(c and c.constraints) for c in fitted]

    rows = {"no controls": {}, "constraints (reference)": {"constraints": constraints},
            "prefix (reference)": {"prefixes": prefixes}, f"{len(bans)} banned phrases": {"bans": bans}}
    translator.translate(sources[:32], beam=args.beam)  # warm-up
    table = Table(title=f"Multi30k test_2016_flickr ({len(sources)} sentences), beam {args.beam}, "
                        f"{args.threads} thread(s), fp32")
    for column in ("controls", "coverage", "BLEU", "sentences/s", "CPU s", "speed vs none (wall, CPU)"):
        table.add_column(column, justify="right" if column != "controls" else "left")
    baseline = None
    for name, controls in rows.items():
        wall, cpu, found = timed(lambda controls=controls: translator.hypotheses(sources, beam=args.beam, **controls),
                                 args.repeats)
        texts = [hyps[0].text for hyps in found]
        bleu = score(texts, [references], options=MetricOptions(language="de"))[0]
        signature = bleu.signature
        coverage = ""
        if "constraints" in controls:
            met = [all(contains([target.processor.piece_to_id(p) for p in hyps[0].pieces], target.encode(c))
                       for c in phrases) for hyps, phrases in zip(found, constraints)]
            covered = sum(m for m, f in zip(met, fit) if f)
            coverage = f"{100 * covered / max(sum(fit), 1):.1f}% of {sum(fit)}"
        baseline = baseline or (wall, cpu)
        table.add_row(name, coverage, f"{bleu.score:.2f}", f"{len(sources) / wall:.1f}", f"{cpu:.1f}",
                      f"{baseline[0] / wall:.2f}x, {baseline[1] / cpu:.2f}x")
    console = Console(width=150)
    console.print(table)
    console.print(f"constraints: {sum(len(c) for c in constraints)} phrases in {len(constraints)} sentences "
                  f"(seed {args.seed}); BLEU {signature}; CPU: {describe_cpu()}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
