"""``nmt run RECIPE``: preprocess -> train -> average -> generate -> score from one YAML file.

A recipe's sections are the commands' options in snake_case (see recipes/README.md)::

    preprocess: {...}          # PreprocessOptions
    arch: NAME                 # plus `model:` overrides
    train: {...}               # TrainConfig (its `data` defaults to preprocess.destdir)
    average: {num_epoch_checkpoints: 5}   # or num_update_checkpoints; output defaults to SAVE_DIR/averaged.pt
    generate: {...}            # GenerateOptions (data, path and output are filled in)
    score: {metrics: bleu}     # the reference is the raw target side of the generated split

Missing sections are skipped; relative paths are taken from the current directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.table import Table

from nmt.errors import NmtError
from nmt.files import read_yaml_mapping
from nmt.log import logger

STAGES = ("preprocess", "train", "average", "generate", "score")


@dataclass
class PipelineReport:
    seconds: dict[str, float] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)
    scores: list = field(default_factory=list)  # nmt.scoring.MetricResult
    translations: Path | None = None
    model: Path | None = None
    data: Path | None = None

    def table(self) -> Table:
        table = Table(title="pipeline")
        for column in ("stage", "seconds", "result"):
            table.add_column(column, justify="right" if column == "seconds" else "left")
        for stage, seconds in self.seconds.items():
            table.add_row(stage, f"{seconds:.1f}", self.results.get(stage, ""))
        return table


def read_document(path: str | Path) -> dict[str, Any]:
    document = read_yaml_mapping(path, "recipe")
    if not document:
        raise NmtError(f"{path} is empty; a recipe has preprocess/train/average/generate/score sections")
    unknown = set(document) - set(STAGES) - {"arch", "model"}
    if unknown:
        raise NmtError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(STAGES)}, arch, model")
    return document


def section(document: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = document.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise NmtError(f"the recipe's `{name}:` section must be a mapping of option: value")
    return dict(value)


def run_recipe(path: str | Path, stages: tuple[str, ...] = STAGES) -> PipelineReport:
    document = read_document(path)
    report = PipelineReport()
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise NmtError(f"unknown stage(s) {', '.join(sorted(unknown))}; stages: {', '.join(STAGES)}")

    def timed(stage: str, work: Callable[[], str]) -> None:
        logger.info("[bold]%s[/bold]", stage, extra={"markup": True})
        start = time.perf_counter()
        report.results[stage] = work()
        report.seconds[stage] = time.perf_counter() - start

    preprocess_options = section(document, "preprocess")
    data_dir = Path(preprocess_options["destdir"]) if preprocess_options and "destdir" in preprocess_options else None
    train_values = section(document, "train") or {}
    if data_dir is not None:
        train_values.setdefault("data", str(data_dir))
    save_dir = Path(train_values.get("save_dir", "checkpoints"))

    if "preprocess" in stages and preprocess_options is not None:
        def run_preprocess() -> str:
            from nmt.data.preprocess import PreprocessOptions, preprocess

            datadir = preprocess(PreprocessOptions(**preprocess_options))
            return f"{datadir.path} ({', '.join(datadir.splits)})"

        timed("preprocess", run_preprocess)
    report.data = data_dir

    if "train" in stages and section(document, "train") is not None:
        def run_train() -> str:
            from nmt.training.config import load_train_config
            from nmt.training.trainer import train

            summary = train(load_train_config({"data": train_values.get("data")}, path))
            return (f"{summary.updates} updates, {summary.epoch} epochs, best valid loss "
                    f"{summary.best_valid_loss:.3f} ({summary.stop_reason})" if summary.best_valid_loss is not None
                    else f"{summary.updates} updates ({summary.stop_reason})")

        timed("train", run_train)

    model_path = save_dir / "checkpoint_best.pt"
    average_options = section(document, "average")
    if average_options is not None:
        output = Path(average_options.pop("output", save_dir / "averaged.pt"))
        if "average" in stages:
            def run_average() -> str:
                from nmt.averaging import average

                used = average([save_dir], output, **average_options)
                return f"{output} (from {len(used)} checkpoints)"

            timed("average", run_average)
        model_path = output
    report.model = model_path

    generate_options = section(document, "generate")
    if generate_options is not None:
        generate_options.setdefault("data", str(data_dir) if data_dir else None)
        generate_options.setdefault("path", str(model_path))
        split = generate_options.setdefault("split", "test")
        generate_options.setdefault("output", str(save_dir / f"{split}.hyp"))
        report.translations = Path(generate_options["output"])
        if "generate" in stages:
            def run_generate() -> str:
                from nmt.generation.generator import GenerateOptions, generate

                generate(GenerateOptions(**generate_options))
                return str(report.translations)

            timed("generate", run_generate)

    score_options = section(document, "score")
    if score_options is not None and "score" in stages:
        if report.translations is None:
            raise NmtError("the recipe's `score:` section needs a `generate:` section")

        def run_score() -> str:
            from nmt.scoring import ScoreOptions, parse_metrics, score_files

            reference = score_options.get("reference") or reference_file(preprocess_options, generate_options["split"])
            metrics = parse_metrics(score_options.get("metrics", "bleu"))
            language = score_options.get("language") or (preprocess_options or {}).get("target_lang")
            options = ScoreOptions(score_options.get("tokenize", "auto"), bool(score_options.get("lowercase")), language)
            report.scores = score_files(report.translations, [reference], metrics, options)
            return "; ".join(f"{r.name} {r.score:.2f}" for r in report.scores)

        timed("score", run_score)
    return report


def reference_file(preprocess_options: dict[str, Any] | None, split: str) -> Path:
    """The raw target-side text of a split named by preprocess (test, test1, valid, ...)."""
    from nmt.data.corpus import find_splits

    if preprocess_options:
        names = ("source_lang", "target_lang", "trainpref", "validpref", "testpref")
        for files in find_splits(*(preprocess_options.get(name) for name in names)):
            if files.name == split:
                return files.target
    raise NmtError(f"cannot find the raw reference of split {split!r}; give `score: {{reference: FILE}}`")
