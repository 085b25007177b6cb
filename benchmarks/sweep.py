"""Tune a recipe on its validation split and keep a record of every run in one CSV.

    # screening: train a variant for a short budget, average, decode val, append a row
    python benchmarks/sweep.py train recipes/multi30k_en_de.yaml --name lr1e-3 --set train.lr=0.001 --max-time 15m

    # decoding: a trained run's averaging window x beam x length penalty, on val (--name: a sweep run,
    # with the recipe it was trained with; without it, the recipe's own save dir)
    python benchmarks/sweep.py decode recipes/multi30k_en_de.yaml --name lr1e-3 --average 0,5,10 --beam 4,6

    # the finalist, once, on the test split (the CSV's `split` column says how often test was scored)
    python benchmarks/sweep.py decode recipes/multi30k_en_de.yaml --split test

Everything is chosen on ``valid``; ``--split test`` is for the final candidates only. A variant
is the recipe with ``--set SECTION.KEY=VALUE`` overrides (YAML values) and its own save dir under
``runs/sweep/NAME``; the preprocessed data directory is shared (preprocess finds it up to date).
Decoding uses the recipe's ``generate:`` settings unless a list is given; a variant of several
models (``--set train.models=2``) is trained side by side and decoded as their ensemble, its row
giving each model's updates, epochs, loss and averaged checkpoints joined by "/". Rows are appended to
``--csv`` (default ``benchmarks/sweep.csv``), so the file is the record of the whole search.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from nmt.checkpoint.averaging import average
from nmt.checkpoint.names import member_dirs, split_paths
from nmt.confinement import Confinement
from nmt.device import describe_cpu, resolve_device, resolve_precision
from nmt.errors import NmtError
from nmt.generation.generate import generate
from nmt.log import setup_logging
from nmt.pipeline import Plan, plan_recipe, reference_file
from nmt.scoring import score_files
from nmt.training.side_by_side import train_models

TRUSTED = Confinement(allow_outside=True)  # the project's own recipes, their paths taken from the checkout's root
COLUMNS = ("date", "mode", "name", "overrides", "arch", "precision", "updates", "epochs", "train_minutes",
           "best_val_loss", "average", "beam", "lenpen", "split", "bleu", "chrf", "cpu")


def variant(recipe: Path, overrides: list[str], save_dir: Path | None, max_time: str | None) -> dict[str, Any]:
    """The recipe's document with ``SECTION.KEY=VALUE`` overrides applied."""
    document: dict[str, Any] = yaml.safe_load(recipe.read_text()) or {}
    for item in overrides:
        key, _, value = item.partition("=")
        *sections, name = key.split(".")
        target = document
        for part in sections:
            target = target.setdefault(part, {})
        target[name] = yaml.safe_load(value)
    if save_dir is not None:
        document.setdefault("train", {})["save_dir"] = str(save_dir)
    if max_time is not None:
        document.setdefault("train", {})["max_time"] = max_time
    return document


def plan_variant(document: dict[str, Any], save_dir: Path | None) -> Plan:
    """Plan the variant; a training variant's recipe stays in its save dir as the record of the run."""
    if save_dir is None:
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "recipe.yaml"
            path.write_text(yaml.safe_dump(document, sort_keys=False))
            return plan_recipe(path, confinement=TRUSTED)
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "recipe.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    return plan_recipe(save_dir / "recipe.yaml", confinement=TRUSTED)


def decode(plan: Plan, checkpoint: str, split: str, beam: int, lenpen: float) -> tuple[float, float]:
    """Cased sacreBLEU and chrF of ``checkpoint`` on ``split``, decoded with the recipe's other settings."""
    first, *others = split_paths(checkpoint)  # an ensemble's output goes beside its first model, named apart
    output = Path(first).with_suffix(f".{'ensemble-' if others else ''}{split}-b{beam}-a{lenpen}.hyp")
    search = dataclasses.replace(plan.generate.search, beam=beam, lenpen=lenpen)
    options = dataclasses.replace(plan.generate, path=[checkpoint], data=plan.data, split=split, search=search,
                                  output=str(output), score_reference=False)
    generate(options, show_progress=False)
    bleu, chrf = score_files(output, [reference_file(plan.preprocess, split)], ["bleu", "chrf"])
    return round(bleu.score, 2), round(chrf.score, 2)


def averaged(plan: Plan, count: int | None) -> tuple[str, str]:
    """The last ``count`` epoch checkpoints of each model of the run averaged (0: checkpoint_best.pt;
    None: those the recipe's `average:` picks, a share of the epochs say), and how many: one model's
    path, or the models' ``a.pt:b.pt`` (an ensemble) for a run of `train: models`, with each model's
    count joined by "/" (a share of the epochs can pick different counts)."""
    found = [averaged_one(plan, save_dir, count)
             for save_dir in member_dirs(plan.train.save_dir, plan.train.models)]
    return ":".join(str(path) for path, _ in found), "/".join(str(used) for _, used in found)


def averaged_one(plan: Plan, save_dir: Path, count: int | None) -> tuple[Path, int]:
    if count == 0 or count is None and plan.average is None:
        return save_dir / "checkpoint_best.pt", 0
    if count is None:
        picked = plan.average
        count = len(average([save_dir], save_dir / "sweep-average.pt", picked.num_epoch_checkpoints,
                            picked.num_update_checkpoints, picked.epoch_share))
        return (save_dir / "sweep-average.pt").rename(save_dir / f"sweep-average{count}.pt"), count
    output = save_dir / f"sweep-average{count}.pt"
    average([save_dir], output, num_epoch_checkpoints=count)
    return output, count


def append(path: Path, rows: list[dict[str, Any]]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS, lineterminator="\n")  # the committed CSV has Unix line ends
        if new:
            writer.writeheader()
        writer.writerows(rows)


def numbers(text: str | None, kind: type) -> list | None:
    return [kind(item) for item in text.split(",")] if text else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("train", "decode"))
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--name", help="train: the run's name (default: recipe), its save dir runs/sweep/NAME; "
                                       "decode: that run, decoded with the recipe it was trained with "
                                       "(default: the recipe's own save dir)")
    parser.add_argument("--label", help="the rows' name in the CSV (default: --name, else 'recipe'); e.g. to "
                                        "tell apart full runs of `nmt run` decoded from the recipe's save dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--max-time", help="train: the screening budget, e.g. 15m (default: the recipe's)")
    parser.add_argument("--average", help="decode: epoch checkpoints to average, e.g. 0,5,10 (0: checkpoint_best)")
    parser.add_argument("--beam", help="decode: beam sizes, e.g. 4,6")
    parser.add_argument("--lenpen", help="decode: GNMT length penalties, e.g. 0.6,1.0")
    parser.add_argument("--split", default="valid", help="decode: the split to score (test only for finalists)")
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("sweep.csv"))
    args = parser.parse_args()
    setup_logging()

    name = args.name or "recipe"
    run_dir = Path("runs/sweep") / name
    if args.mode == "train":
        plan = plan_variant(variant(args.recipe, args.overrides, run_dir, args.max_time), run_dir)
    elif args.name:
        if not (run_dir / "recipe.yaml").is_file():
            raise NmtError(f"no sweep run at {run_dir}: train it first with `sweep.py train --name {args.name}`")
        plan = plan_variant(variant(run_dir / "recipe.yaml", args.overrides, None, None), None)
    else:
        plan = plan_variant(variant(args.recipe, args.overrides, None, None), None)
    precision, _ = resolve_precision(plan.train.compute.precision, resolve_device(plan.train.compute.device))
    row = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": args.mode, "name": args.label or name,
           "overrides": " ".join(args.overrides), "arch": plan.train.arch, "precision": precision,
           "cpu": describe_cpu()}
    if args.mode == "train":
        if plan.preprocess is not None:
            from nmt.data.preprocess import preprocess
            preprocess(plan.preprocess, show_progress=False)
        summaries = train_models(plan.train)  # models side by side: each one's figures, joined by "/"
        row.update({key: "/".join(str(value) for value in values) for key, values in (
            ("updates", [summary.updates for summary in summaries]),
            ("epochs", [summary.epoch for summary in summaries]),
            ("train_minutes", [round(summary.seconds / 60, 1) for summary in summaries]),
            ("best_val_loss", [round(summary.best_valid_loss, 4) if summary.best_valid_loss else ""
                               for summary in summaries]))})
    windows = numbers(args.average, int) or [None]  # None: the recipe's own window
    beams = numbers(args.beam, int) or [plan.generate.search.beam]
    lenpens = numbers(args.lenpen, float) or [plan.generate.search.lenpen]
    rows = []
    for window in windows:
        checkpoint, count = averaged(plan, window)
        for beam, lenpen in itertools.product(beams, lenpens):
            bleu, chrf = decode(plan, checkpoint, args.split, beam, lenpen)
            rows.append({**row, "average": count, "beam": beam, "lenpen": lenpen, "split": args.split,
                         "bleu": bleu, "chrf": chrf})
            print(f"{row['name']}: average {count}, beam {beam}, lenpen {lenpen}: {args.split} BLEU {bleu} chrF {chrf}")
    append(args.csv, rows)


if __name__ == "__main__":
    try:
        main()
    except NmtError as error:
        raise SystemExit(f"error: {error}")
