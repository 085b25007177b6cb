"""``nmt run RECIPE``: preprocess -> train -> average -> generate -> score from one YAML file.

The recipe (nmt/recipe.py) is planned first: every section becomes its command's options
dataclass, the model overrides are checked against the arch, and the paths one stage hands the
next are filled in, so a typo in ``score:`` fails before preprocessing starts, not after days of
training. ``--dry-run`` prints that plan and stops. Missing sections are skipped; relative paths
are taken from the current directory.

A recipe reads and writes only under its own directory (or the directories the user names), and
replaces only files it wrote itself (nmt/confinement.py): checked when planning, unless the
recipe is trusted like code (``nmt run --allow-outside``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from rich.table import Table

from nmt.checkpoint.names import BEST, member_dirs, member_files
from nmt.checkpoint.options import AverageOptions
from nmt.confinement import Confinement, path_values
from nmt.data.corpus import SPLIT_KINDS, SplitFiles, find_splits, split_prefixes, text_file_names
from nmt.data.meta import DatasetMeta, is_data_directory
from nmt.data.preprocess import PreprocessOptions
from nmt.errors import NmtError
from nmt.files import refuse_overwriting
from nmt.generation.options import GenerateOptions
from nmt.log import logger
from nmt.options import build, check_keys, flat_values
from nmt.recipe import STAGES, checked_search, data_dir, data_key, read_document, section, train_values
from nmt.scoring import ScoreOptions
from nmt.training.config import TrainConfig
from nmt.written import record_written


@dataclass
class Plan:
    """Every stage's resolved options (None: the recipe has no such section) and the stages to run."""

    stages: tuple[str, ...]
    data: str | None = None  # the data directory the stages share
    checkpoint: str | None = None  # the model(s) generate uses (a.pt:b.pt): checkpoint_best.pt or the average(s)
    preprocess: PreprocessOptions | None = None
    train: TrainConfig | None = None
    model: Any = None  # the arch's config with the recipe's `model:` overrides, when there is a train stage
    average: AverageOptions | None = None
    averages: list[AverageOptions] = field(default_factory=list)  # one per model trained (train: models)
    generate: GenerateOptions | None = None
    score: ScoreOptions | None = None

    def describe(self) -> str:
        """The resolved configuration of every stage, as YAML."""
        resolved: dict[str, Any] = {"stages": list(self.stages), "data": self.data, "checkpoint": self.checkpoint}
        for stage in STAGES:
            options = getattr(self, stage)
            if options is not None:
                resolved[stage] = flat_values(options)
                if stage == "train":
                    resolved[stage]["model"] = dataclasses.asdict(self.model)
                if stage == "average" and len(self.averages) > 1:  # what runs: each model's average
                    resolved[stage]["inputs"] = [each.inputs for each in self.averages]
                    resolved[stage]["output"] = [each.output for each in self.averages]
        return yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True)


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


def plan_recipe(path: str | Path, stages: tuple[str, ...] = STAGES, confinement: Confinement = Confinement()) -> Plan:
    """Read and check the whole recipe: each section's options, with the paths between stages filled in,
    and every path the stages to run read or write within the places ``confinement`` allows."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise NmtError(f"unknown stage(s) {', '.join(sorted(unknown))}; stages: {', '.join(STAGES)}")
    document, where = read_document(path), str(path)
    plan = Plan(stages, data_dir(document))
    if (values := section(document, "preprocess")) is not None:
        plan.preprocess = build(PreprocessOptions, values, "preprocess", where)
        if "preprocess" in stages:
            raw_splits(plan.preprocess)  # the raw text is there (a stat of each file; read when the stage runs)
    train = build(TrainConfig, train_values(document, path), "train", where)
    model = resolve_model(train, where)  # `arch:`/`model:` are checked even without a train section
    if section(document, "train") is not None:
        if not train.data:
            raise NmtError(f"{where}: the train section needs a data directory: `data:`, or a preprocess section's "
                           "destdir")
        plan.train, plan.model = train, model
        if (needs := train.needs_validation()) and not validates(train, plan.preprocess):
            raise NmtError(f"{where}: `train:` gives {needs}, which needs validation: give `preprocess: validpref`")
    save_dir = Path(train.save_dir)
    members = member_dirs(save_dir, train.models)
    model_paths = [directory / BEST for directory in members]
    if (values := section(document, "average")) is not None:
        plan.average = build(AverageOptions, {"inputs": [str(save_dir)], "output": str(save_dir / "averaged.pt"),
                                              **checked_search(document, path), **values}, "average", where)
        if len(plan.average.selection()) != 1:
            raise NmtError(f"{where}: the `average:` section needs num_epoch_checkpoints, num_update_checkpoints or "
                           "epoch_share (exactly one)")
        plan.averages = [plan.average]
        if plan.average.inputs == [str(save_dir)]:  # averaging this run's checkpoints: each model's
            plan.averages = [dataclasses.replace(plan.average, inputs=[str(directory)], output=str(output))
                             for directory, output in zip(members, member_files(plan.average.output, train.models))]
            if plan.train is not None:
                check_checkpoints_kept(plan.train, plan.average, where)
                if "check_decoding" not in (section(document, "train") or {}):  # averaging checks what generate uses
                    plan.train = dataclasses.replace(plan.train, check_decoding=False)
        model_paths = [Path(options.output) for options in plan.averages]
    plan.checkpoint = ":".join(str(path) for path in model_paths)
    if (values := section(document, "generate")) is not None:
        defaults = {"path": plan.checkpoint} if "input" in values else {"path": plan.checkpoint, "data": plan.data}
        plan.generate = build(GenerateOptions, {**defaults, **values}, "generate", where)
        if "path" not in values and plan.average is None and plan.train is not None \
                and not validates(plan.train, plan.preprocess):
            raise NmtError(f"{where}: `generate:` uses {BEST}, which training writes only when it validates: give "
                           "`preprocess: validpref`, an `average:` section or `generate: path`")
        if "path" not in values and "generate" in stages and plan.average is not None \
                and "train" in stages and "average" not in stages:
            raise NmtError(f"{where}: --stages trains but does not average: `generate:` would translate with "
                           f"{plan.checkpoint}, made before this training; add the average stage")
        missing = [path for path in model_paths if not path.exists()]
        if "path" not in values and "generate" in stages and not {"train", "average"} & set(stages) and missing:
            raise NmtError(f"{where}: `generate:` translates with {missing[0]}, which is not there: run the "
                           f"{'average' if plan.average is not None else 'train'} stage first")
        if "output" not in values:
            plan.generate = dataclasses.replace(plan.generate, output=str(save_dir / f"{plan.generate.split}.hyp"))
        refuse_overwriting(f"{where}: `generate: output`", plan.generate.output, {"recipe": str(path)})
    if (values := section(document, "score")) is not None:
        if plan.generate is None:
            raise NmtError(f"{where}: the `score:` section needs a `generate:` section")
        if "ref" not in values and plan.generate.input is not None and "score" in stages:
            raise NmtError(f"{where}: `generate:` translates `input: {plan.generate.input}`, not a split of the "
                           "data: give `score: ref` (its reference)")
        recorded = DatasetMeta.load(Path(plan.data)) if plan.preprocess is None and plan.data \
            and is_data_directory(Path(plan.data)) else None  # a data directory made before this recipe
        reference = [] if "ref" in values or "score" not in stages else \
            [str(reference_file(plan.preprocess, plan.generate.split, recorded))]
        target_lang = plan.preprocess.target_lang if plan.preprocess is not None else \
            recorded.target_lang if recorded is not None else None
        language = {"language": target_lang} if target_lang else {}
        plan.score = build(ScoreOptions, {"system": plan.generate.output, "ref": reference, **language, **values},
                           "score", where)
    if plan.generate is not None:
        refuse_overwriting("generate: output", plan.generate.output,
                           {"raw text of preprocess": raw_text_paths(plan.preprocess),
                            "score: reference": plan.score.ref if plan.score else None})
    if stages != STAGES:  # asked for by name: a stage the recipe has no section for would do nothing unseen
        missing = [stage for stage in stages if getattr(plan, stage) is None]
        if missing:
            raise NmtError(f"{where}: --stages {','.join(missing)}: the recipe has no "
                           f"{' or '.join(f'`{stage}:`' for stage in missing)} section")
    outputs = output_paths(plan)
    confinement.check(Path(path), outputs, input_paths(plan, set(outputs), document), file_outputs(plan),
                      save_dir=outputs.get("train: save_dir"))
    return plan


def output_paths(plan: Plan) -> dict[str, str]:
    """What the stages to run write, by recipe key."""
    outputs = {}
    for stage, keys in (("preprocess", ("destdir",)), ("train", ("save_dir", "tensorboard_dir")),
                        ("average", ("output",)), ("generate", ("output", "print_attention"))):
        options = getattr(plan, stage)
        if stage in plan.stages and options is not None:
            outputs.update({f"{stage}: {key}": getattr(options, key) for key in keys
                            if getattr(options, key) is not None})
    if "average" in plan.stages and len(plan.averages) > 1:
        del outputs["average: output"]
        outputs.update({f"average: output (model {index})": options.output
                        for index, options in enumerate(plan.averages, 1)})
    return outputs


def input_paths(plan: Plan, outputs: set[str], document: dict[str, Any]) -> dict[str, object]:
    """What the stages to run read, by the recipe (``document``) key that gave each: their path options
    that are not outputs."""
    inputs = {}
    for stage in plan.stages:
        options = getattr(plan, stage)
        if options is not None:
            for key, value in path_values(options).items():
                name = data_key(document, stage) if key == "data" else f"{stage}: {key}"
                if name not in outputs and value is not None:
                    inputs[name] = value
    return inputs


def file_outputs(plan: Plan) -> list[str]:
    """The files the stages to run write whole (not directories): what may replace only their own earlier runs."""
    files = []
    if "average" in plan.stages:
        files += [options.output for options in plan.averages]
    if "generate" in plan.stages and plan.generate is not None:
        files += [path for path in (plan.generate.output, plan.generate.print_attention) if path is not None]
    return files


def check_checkpoints_kept(train: TrainConfig, average: AverageOptions, where: str) -> None:
    """The average stage must find the checkpoints it averages: training saves and keeps enough of them."""
    wanted, kept = average.num_epoch_checkpoints, train.keep_last_epochs
    if wanted is not None and 0 <= kept < wanted:
        raise NmtError(f"{where}: `average:` takes the last {wanted} epoch checkpoints but `train: keep_last_epochs: "
                       f"{kept}` keeps {kept}")
    wanted, kept = average.num_update_checkpoints, train.keep_interval_updates
    if wanted is not None and not train.save_interval_updates:
        raise NmtError(f"{where}: `average:` takes update checkpoints, which training saves only with "
                       "`train: save_interval_updates`")
    if wanted is not None and 0 <= kept < wanted:
        raise NmtError(f"{where}: `average:` takes the last {wanted} update checkpoints but `train: "
                       f"keep_interval_updates: {kept}` keeps {kept}")


def validates(train: TrainConfig, preprocess: PreprocessOptions | None) -> bool:
    """Whether training will validate (and so write checkpoint_best.pt), as far as the recipe says."""
    if not train.valid_subsets:
        return False
    return preprocess is None or train.valid_subsets != ["valid"] or bool(preprocess.validpref)


def resolve_model(train: TrainConfig, where: str) -> Any:
    from nmt.models.registry import get_arch, resolve_config

    arch = get_arch(train.arch)
    check_keys(train.model, [spec.name for spec in dataclasses.fields(arch.config)], "model", where)
    return resolve_config(arch.config, train.model)


def raw_splits(options: PreprocessOptions) -> list[SplitFiles]:
    """The raw text files of every split preprocess reads; a missing one is an error."""
    return find_splits(options.source_lang, options.target_lang, options.trainpref, options.validpref,
                       options.testpref)


def raw_text_paths(preprocess: PreprocessOptions | None) -> list[Path]:
    """Every path the recipe's raw text may have (plain or .gz), whether or not it is still there: the
    training text may be archived once preprocessed, and an output must not land on any of them."""
    if preprocess is None:
        return []
    prefixes = [prefix for option in (preprocess.trainpref, preprocess.validpref, preprocess.testpref) if option
                for prefix in split_prefixes(option)]
    return [path for prefix in prefixes for language in (preprocess.source_lang, preprocess.target_lang)
            for path in text_file_names(prefix, language)]


def reference_file(preprocess: PreprocessOptions | None, split: str, recorded: DatasetMeta | None = None) -> Path:
    """The raw target-side text of a split named by preprocess (test, test1, valid, ...), else the one
    a data directory's meta.json (``recorded``) names for it (a recipe with `data:`, no preprocess section).
    Only that split's files are looked for: the training text may be gone once it is preprocessed."""
    if preprocess is not None:
        prefixes = {f"{kind}pref": getattr(preprocess, f"{kind}pref") if split.startswith(kind) else None
                    for kind in SPLIT_KINDS}
        for files in find_splits(preprocess.source_lang, preprocess.target_lang, **prefixes):
            if files.name == split:
                return files.target
    elif recorded is not None and (entry := recorded.splits.get(split)) is not None \
            and entry.target_file and Path(entry.target_file).is_file():
        return Path(entry.target_file)
    raise NmtError(f"cannot find the raw reference of split {split!r}; give `score: {{ref: [FILE]}}`")


def warn_if_older_than_its_checkpoints(averaged: Path, inputs: list[str]) -> None:
    """An average made before the checkpoints its save dir holds now (another `nmt run` trained on):
    generate would translate with the older model, so say so."""
    if not averaged.is_file():
        return
    newer = [path for directory in inputs if Path(directory).is_dir()
             for path in Path(directory).glob("checkpoint*.pt") if path.stat().st_mtime > averaged.stat().st_mtime]
    if newer:
        logger.warning("%s is older than %d checkpoint(s) of its save dir (%s, ...): it was averaged before them; run "
                       "the average stage to translate with them", averaged, len(newer),
                       max(newer, key=lambda path: path.stat().st_mtime).name)


def run_plan(plan: Plan) -> PipelineReport:
    """Run the planned stages in order, each fed by the one before."""
    report = PipelineReport(model=Path(plan.checkpoint), data=Path(plan.data) if plan.data else None)
    if plan.generate is not None:
        report.translations = Path(plan.generate.output)

    def timed(stage: str, work: Callable[[], str]) -> None:
        if stage not in plan.stages or getattr(plan, stage) is None:
            return
        logger.info("[bold]%s[/bold]", stage, extra={"markup": True})
        start = time.perf_counter()
        report.results[stage] = work()
        report.seconds[stage] = time.perf_counter() - start

    def run_preprocess() -> str:
        from nmt.data.preprocess import preprocess

        datadir = preprocess(plan.preprocess)
        return f"{datadir.path} ({', '.join(datadir.splits)})"

    def run_train() -> str:
        from nmt.training.side_by_side import train_models

        summaries = train_models(plan.train)
        if len(summaries) == 1:
            return summaries[0].outcome()
        return "; ".join(f"model {index}: {summary.outcome()}" for index, summary in enumerate(summaries, 1))

    def run_average() -> str:
        from nmt.checkpoint.averaging import average
        from nmt.training.decoding_check import check_averaged

        results = []
        for options in plan.averages:
            used = average(options.inputs, options.output, **options.selection())
            check_averaged(options.output, used, options.check_search.search())
            record_written(options.output)  # after the check, which writes its record into the checkpoint
            results.append(f"{options.output} (from {len(used)} checkpoints)")
        return "; ".join(results)

    def run_generate() -> str:
        from nmt.generation.generate import generate

        if plan.average is not None and "average" not in plan.stages:
            for options in plan.averages:
                warn_if_older_than_its_checkpoints(Path(options.output), options.inputs)
        generate(plan.generate)
        for output in (plan.generate.output, plan.generate.print_attention):
            if output is not None:
                record_written(output)
        return str(plan.generate.output)

    def run_score() -> str:
        from nmt.scoring import parse_metrics, score_files

        options = plan.score
        report.scores = score_files(options.system, options.ref, parse_metrics(options.metrics), options.metric)
        return "; ".join(f"{r.name} {r.score:.2f}" for r in report.scores)

    for stage, work in (("preprocess", run_preprocess), ("train", run_train), ("average", run_average),
                        ("generate", run_generate), ("score", run_score)):
        timed(stage, work)
    return report


def run_recipe(path: str | Path, stages: tuple[str, ...] = STAGES, confinement: Confinement = Confinement()
               ) -> PipelineReport:
    return run_plan(plan_recipe(path, stages, confinement))
