"""The `nmt` command line: parsing only; every command calls a library function."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

import nmt
from nmt.errors import NmtError
from nmt.log import logger, setup_logging, state

app = typer.Typer(
    name="nmt",
    help="Neural machine translation with the Transformer: preprocess, train, average, generate, score.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Options every subcommand shares; call `common(...)` first thing in each command.
Verbose = Annotated[int, typer.Option("--verbose", "-v", count=True, help="More detail; tracebacks on errors.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Only warnings and errors.")]


class LogFormatChoice(str, Enum):
    text = "text"
    json = "json"


LogFormat = Annotated[LogFormatChoice, typer.Option("--log-format", help="Log lines as rich text or JSON lines.")]
Overrides = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE", help="Override a model hyper-parameter of the arch, e.g. --set dropout=0.2 "
    "(repeatable).")]


def common(verbose: int, quiet: bool, log_format: LogFormatChoice) -> None:
    setup_logging(verbose, quiet, LogFormatChoice(log_format).value)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"nmt {nmt.__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Neural machine translation with the Transformer."""


@app.command()
def archs(
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size used for the parameter counts.")] = 37000,
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """List the registered architectures with their hyper-parameters and parameter counts."""
    common(verbose, quiet, log_format)
    from nmt.models.listing import print_arch_table

    print_arch_table(vocab_size)


@app.command()
def average(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="INPUTS...", show_default=False,
        help="A save dir (with --num-epoch-checkpoints/--num-update-checkpoints) or the checkpoint files to average.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the averaged model-only checkpoint.")],
    num_epoch_checkpoints: Annotated[Optional[int], typer.Option(
        min=1, help="Average the last N checkpoint{epoch}.pt files of the save dir.")] = None,
    num_update_checkpoints: Annotated[Optional[int], typer.Option(
        min=1, help="Average the last N checkpoint_{epoch}_{update}.pt files of the save dir.")] = None,
    inputs_flag: Annotated[bool, typer.Option(
        "--inputs", help="Optional, fairseq's spelling: `--inputs a.pt b.pt` is the same as `a.pt b.pt`.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Average the parameters of checkpoints (the paper: last 5 for base, last 20 for big)."""
    common(verbose, quiet, log_format)
    from nmt.averaging import average as average_checkpoints

    average_checkpoints(inputs, output, num_epoch_checkpoints, num_update_checkpoints)


class ModelTypeChoice(str, Enum):
    bpe = "bpe"
    unigram = "unigram"


@app.command()
def preprocess(
    source_lang: Annotated[str, typer.Option("--source-lang", "-s", help="Source language: the suffix of its files.")],
    target_lang: Annotated[str, typer.Option("--target-lang", "-t", help="Target language: the suffix of its files.")],
    destdir: Annotated[str, typer.Option(help="Data directory to write (replaced only once complete).")],
    trainpref: Annotated[Optional[str], typer.Option(
        help="Training text: PREFIX.SRC and PREFIX.TGT, plain or .gz.")] = None,
    validpref: Annotated[Optional[str], typer.Option(
        help="Validation text prefix(es), comma-separated: splits valid, valid1, ...")] = None,
    testpref: Annotated[Optional[str], typer.Option(
        help="Test text prefix(es), comma-separated: splits test, test1, ...")] = None,
    joint: Annotated[bool, typer.Option("--joint/--no-joint", help="One sentencepiece model for both languages.")] = True,
    vocab_size: Annotated[int, typer.Option(help="Sentencepiece vocabulary size (per model).")] = 37000,
    model_type: Annotated[ModelTypeChoice, typer.Option(help="Sentencepiece model type.")] = ModelTypeChoice.bpe,
    character_coverage: Annotated[float, typer.Option(
        help="Share of characters the vocabulary covers (0.9995 for languages with large alphabets).")] = 1.0,
    input_sentence_size: Annotated[int, typer.Option(
        help="Sentences sampled to train sentencepiece (0 = all).")] = 10_000_000,
    spm_model: Annotated[Optional[str], typer.Option(
        help="Reuse a sentencepiece model instead of training one: PATH, or SRC_PATH,TGT_PATH "
        "(then --joint, --vocab-size and the other training options do not apply).")] = None,
    max_len: Annotated[int, typer.Option(
        help="Drop training pairs with a side over this many tokens, EOS included (0 = no limit).")] = 250,
    max_len_ratio: Annotated[float, typer.Option(
        help="Drop training pairs whose longer side has over this many times the tokens of the other (0 = off).")] = 9.0,
    workers: Annotated[int, typer.Option(help="Sentencepiece threads for training and encoding.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace a destdir that holds a different dataset.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Train sentencepiece on parallel text and binarize it into a data directory for train and generate."""
    common(verbose, quiet, log_format)
    from rich.console import Console

    from nmt.data import preprocess as lib

    options = lib.PreprocessOptions(
        source_lang=source_lang, target_lang=target_lang, destdir=destdir, trainpref=trainpref, validpref=validpref,
        testpref=testpref, joint=joint, vocab_size=vocab_size, model_type=ModelTypeChoice(model_type).value,
        character_coverage=character_coverage, input_sentence_size=input_sentence_size, spm_model=spm_model,
        max_len=max_len, max_len_ratio=max_len_ratio, workers=workers, force=force)
    datadir = lib.preprocess(options, show_progress=not quiet and LogFormatChoice(log_format) is LogFormatChoice.text)
    if not quiet:
        Console().print(lib.summary_table(datadir))


@app.command()
def score(
    system: Annotated[str, typer.Option("--sys", help="Detokenized system output, one line per segment ('-' = stdin).")],
    ref: Annotated[list[str], typer.Option(help="Reference file (repeat for several references); plain or .gz.")],
    metrics: Annotated[str, typer.Option(help="Comma-separated metrics from bleu, chrf, ter.")] = "bleu",
    lowercase: Annotated[bool, typer.Option(help="Case-insensitive scores (sacrebleu's default is cased).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the scores as JSON.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Score a system output with sacrebleu (BLEU with 13a tokenization, cased) and print the signatures."""
    common(verbose, quiet, log_format)
    from nmt.scoring import format_results, parse_metrics, score_files

    results = score_files(system, ref, parse_metrics(metrics), lowercase)
    typer.echo(format_results(results, as_json=json_output))


def main() -> None:
    try:
        app()
    except NmtError as exc:
        if state["verbose"]:
            logger.exception("error")
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
