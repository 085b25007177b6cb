"""The `nmt` command line: each command is an options dataclass (its fields become the options:
nmt/commands.py) plus one library call, given the options from the command line; the library adds
the recipe's and the defaults. Only the torch-free options are imported here: each command imports
its library when it runs, so `nmt --help` and `nmt score` never import torch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from nmt.checkpoint.options import AverageOptions
from nmt.commands import Group, command, run_app, sub_app
from nmt.confinement import ALLOW_OUTSIDE_HELP, INPUT_DIR_HELP, OUTPUT_DIR_HELP, Confinement
from nmt.data.preprocess import PreprocessOptions
from nmt.export.options import ExportOptions
from nmt.generation.options import GenerateOptions
from nmt.log import logger, state, stdout_console
from nmt.options import build
from nmt.plot.options import PlotAttentionOptions, PlotCurvesOptions
from nmt.recipe import STAGES, parse_stages
from nmt.scoring import ScoreOptions
from nmt.serving.options import ServeOptions
from nmt.training.config import TrainConfig, load_train_config
from nmt.version import __version__

if TYPE_CHECKING:
    from nmt.pipeline import PipelineReport

# Where a recipe (`nmt run`) or a --config file (`nmt train`) may read and write: a Confinement.
OutputDir = Annotated[Optional[Path], typer.Option(help=OUTPUT_DIR_HELP)]
InputDirs = Annotated[Optional[list[Path]], typer.Option(help=INPUT_DIR_HELP, exists=True, file_okay=False)]
AllowOutside = Annotated[bool, typer.Option(help=ALLOW_OUTSIDE_HELP)]

app = typer.Typer(
    name="nmt",
    help="Neural machine translation with the Transformer: preprocess, train, average, generate, score.",
    no_args_is_help=True,
    add_completion=False,
    cls=Group,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                                        help="Print the version and exit.")] = False) -> None:
    """Neural machine translation with the Transformer."""


@command(app)
def archs(vocab_size: Annotated[int, typer.Option(help="Vocabulary size used for the parameter counts.", min=1)] = 37000
          ) -> None:
    """List the registered architectures with their hyper-parameters and parameter counts."""
    from nmt.models.listing import print_arch_table

    print_arch_table(vocab_size)


@command(app, name="build-kernels")
def build_kernels() -> None:
    """Build nmt's C kernels for this CPU now, rather than on first use (decoding on a CPU needs them)."""
    from nmt.backends.kernel_build import build_ahead

    typer.echo(build_ahead())


@command(app, AverageOptions)
def average(given: dict, inputs_flag: Annotated[bool, typer.Option(
        "--inputs", help="Optional, fairseq's spelling: `--inputs a.pt b.pt` is the same as `a.pt b.pt`.")] = False
            ) -> None:
    """Average the parameters of checkpoints (the paper: last 5 for base, last 20 for big).

    Then, with the run's data here, records which of int8 and the faster stop rules keep its validation BLEU (auto's) in
    the search that --check-beam, --check-lenpen, ... name (give generate's)."""
    from nmt.checkpoint.averaging import average as average_checkpoints
    from nmt.training.decoding_check import check_averaged

    options = build(AverageOptions, given, "average")
    averaged = average_checkpoints(options.inputs, options.output, **options.selection())
    check_averaged(options.output, averaged, options.check_search.search())


@command(app, PreprocessOptions)
def preprocess(given: dict) -> None:
    """Train sentencepiece on parallel text and binarize it into a data directory for train and generate."""
    from nmt.data.preprocess import preprocess as run_preprocess
    from nmt.data.summary import summary_table

    datadir = run_preprocess(build(PreprocessOptions, given, "preprocess"), show_progress=state["progress"])
    if logger.isEnabledFor(logging.INFO):
        stdout_console().print(summary_table(datadir))


@command(app, ScoreOptions)
def score(given: dict) -> None:
    """Score a system output with sacrebleu (BLEU tokenized for the target language, cased) and print the signatures."""
    from nmt.scoring import format_results, parse_metrics, score_files

    options = build(ScoreOptions, given, "score")
    results = score_files(options.system, options.ref, parse_metrics(options.metrics), options.metric)
    typer.echo(format_results(results, as_json=options.json_output))


@command(app, TrainConfig)
def train(given: dict, config: Annotated[Optional[Path], typer.Option(
        help="YAML recipe: its `train:` section (keys = these options, with _), top-level `arch:`/`model:` and its "
             "data directory (`data:` or `preprocess: destdir`). Options given here override it.")] = None,
          output_dir: OutputDir = None, input_dir: InputDirs = None, allow_outside: AllowOutside = False) -> None:
    """Train a model on a preprocessed data directory; re-running the same command resumes. Several GPUs:
    --nproc N; several machines: torchrun --nnodes M --nproc-per-node N --rdzv-endpoint HOST:PORT -m nmt train"""
    from nmt.training.side_by_side import train_models

    confinement = Confinement.from_command_line(allow_outside, output_dir, input_dir)
    train_models(load_train_config(given, config, confinement))


@command(app, GenerateOptions)
def generate(given: dict) -> None:
    """Translate a binarized split or raw text with beam search (defaults: the paper's beam 4, alpha 0.6).
    Output: one line per input line (--nbest K: K lines), in input order; empty in, empty out."""
    from nmt.generation.generate import generate as run_generation

    result = run_generation(build(GenerateOptions, given, "generate"), show_progress=state["progress"])
    for metric in result.scores:  # stderr: stdout holds only translations
        typer.echo(metric.formatted, err=True)


@command(app, ServeOptions)
def serve(given: dict) -> None:
    """Serve translations over HTTP (needs the serve extra of nmt): POST /translate, GET /health, GET /info."""
    from nmt.serving.server import serve as run_server

    run_server(build(ServeOptions, given, "serve"))


plot_app = sub_app(app, "plot", "Draw attention maps and training curves as images (needs the plot extra of nmt).")


@command(plot_app, PlotAttentionOptions, "attention", "plot ")
def plot_attention(given: dict) -> None:
    """Heat maps of one layer's attention heads for a sentence (the paper's Figures 3-5)."""
    from nmt.plot.attention import plot_attention as draw

    draw(build(PlotAttentionOptions, given, "plot attention"))


@command(plot_app, PlotCurvesOptions, "curves", "plot ")
def plot_curves(given: dict) -> None:
    """Train/valid loss, valid BLEU, learning rate and tokens/s against updates, from SAVE_DIR/metrics.jsonl."""
    from nmt.plot.curves import plot_curves as draw

    draw(build(PlotCurvesOptions, given, "plot curves"))


export_app = sub_app(app, "export", "Export a checkpoint to another inference engine.")


@command(export_app, ExportOptions, "ctranslate2", "export ")
def export_ctranslate2(given: dict) -> None:
    """Write a CTranslate2 model directory (needs the ct2 extra of nmt), with the sentencepiece model(s) beside it."""
    from nmt.export.ctranslate2 import export_ctranslate2 as run_export

    run_export(build(ExportOptions, given, "export ctranslate2"))


@command(app)
def run(recipe: Annotated[Path, typer.Argument(metavar="RECIPE",
            help="YAML recipe with preprocess/train/average/generate/score sections.")],
        stages: Annotated[str, typer.Option(help="Comma-separated stages to run.")] = ",".join(STAGES),
        dry_run: Annotated[bool, typer.Option(
            help="Check the whole recipe, print every stage's resolved options, and run nothing.")] = False,
        output_dir: OutputDir = None, input_dir: InputDirs = None, allow_outside: AllowOutside = False) -> None:
    """Run a recipe's whole pipeline: preprocess -> train -> average -> generate -> score."""
    from nmt.pipeline import plan_recipe, run_plan

    confinement = Confinement.from_command_line(allow_outside, output_dir, input_dir)
    plan = plan_recipe(recipe, parse_stages(stages), confinement)
    if dry_run:
        typer.echo(plan.describe(), nl=False)
    else:
        print_report(run_plan(plan))


def print_report(report: PipelineReport) -> None:
    """The stages' table on stderr (in text logs only: JSON logs stay pure JSON lines); the scores on stdout."""
    if state["format"] == "text":
        Console(stderr=True).print(report.table())
    for result in report.scores:
        typer.echo(result.formatted)


@command(app)
def demo(workdir: Annotated[Path, typer.Option(help="Where the demo writes its data, model and translations.")] =
         Path("nmt-demo"),
         max_update: Annotated[int, typer.Option(help="Training updates (at least 1).")] = 300) -> None:
    """Train and evaluate on an embedded toy task (numbers in words, EN->DE) on the CPU: no download."""
    from nmt.demo import run_demo

    report = run_demo(workdir, max_update)
    print_report(report)
    typer.echo(f"data: {report.data}  model: {report.model}  translations: {report.translations}")


def main() -> None:
    """The console script: every error the user can cause ends in one `error:` line (-v: with its traceback)."""
    run_app(app)
