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


class PrecisionChoice(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


BATCHING, OPTIM, DEVICES, CHECKPOINTS, STOPPING, REPORTING = (
    "Batching", "Optimisation", "Devices", "Checkpoints", "Stopping", "Validation and logging")


def train_option(help: str, panel: str, *names: str, **kwargs) -> typer.models.OptionInfo:
    return typer.Option(*names, help=help, rich_help_panel=panel, show_default=False, **kwargs)


@app.command()
def train(
    data: Annotated[Optional[str], typer.Argument(
        metavar="DATA_DIR", show_default=False, help="Data directory written by `nmt preprocess`.")] = None,
    config: Annotated[Optional[Path], typer.Option(
        help="YAML recipe: its `train:` section (keys = these options, with _) and top-level `arch:`/`model:`. "
        "Options given here override it.")] = None,
    arch: Annotated[Optional[str], typer.Option(
        help="Architecture from `nmt archs` (default: transformer_base).")] = None,
    model_set: Overrides = None,
    save_dir: Annotated[Optional[str], train_option(
        "Checkpoint directory (default: checkpoints).", CHECKPOINTS)] = None,
    max_tokens: Annotated[Optional[int], train_option(
        "Tokens per batch, padding included (default 4096; the paper: 25000).", BATCHING)] = None,
    max_sentences: Annotated[Optional[int], train_option("Sentences per batch at most.", BATCHING)] = None,
    required_batch_size_multiple: Annotated[Optional[int], train_option(
        "Round batch sizes down to a multiple of this (tensor cores) (default: 8).", BATCHING)] = None,
    update_freq: Annotated[Optional[int], train_option(
        "Accumulate gradients over N batches per update (N times more GPUs) (default: 1).", BATCHING)] = None,
    skip_invalid_size_inputs: Annotated[Optional[bool], train_option(
        "Skip training pairs longer than --max-tokens (with a count) instead of stopping.", BATCHING,
        "--skip-invalid-size-inputs/--no-skip-invalid-size-inputs")] = None,
    prefetch: Annotated[Optional[int], train_option(
        "Updates prepared ahead by a background thread (0: none) (default: 4).", BATCHING)] = None,
    train_subset: Annotated[Optional[str], train_option("Split to train on (default: train).", BATCHING)] = None,
    valid_subset: Annotated[Optional[str], train_option(
        "Split to validate on; none: no validation (default: valid).", BATCHING)] = None,
    lr: Annotated[Optional[float], train_option(
        "Peak learning rate (fairseq's form, e.g. 7e-4); without it, the paper's d_model^-0.5 formula.", OPTIM)] = None,
    lr_scheduler: Annotated[Optional[str], train_option(
        "Learning-rate schedule (default: inverse_sqrt).", OPTIM)] = None,
    warmup_updates: Annotated[Optional[int], train_option("Linear warm-up updates (default: 4000).", OPTIM)] = None,
    adam_betas: Annotated[Optional[str], train_option(
        "Adam betas, e.g. '0.9,0.98' (default: 0.9,0.98).", OPTIM)] = None,
    adam_eps: Annotated[Optional[float], train_option("Adam epsilon (default: 1e-9).", OPTIM)] = None,
    weight_decay: Annotated[Optional[float], train_option("Decoupled weight decay (default: 0).", OPTIM)] = None,
    clip_norm: Annotated[Optional[float], train_option(
        "Clip the gradient norm to this (default 0: off).", OPTIM)] = None,
    label_smoothing: Annotated[Optional[float], train_option("Label smoothing epsilon (default: 0.1).", OPTIM)] = None,
    seed: Annotated[Optional[int], train_option(
        "Random seed: initialisation, batch order, dropout (default: 1).", OPTIM)] = None,
    device: Annotated[Optional[str], train_option("auto, cpu or cuda (default: auto).", DEVICES)] = None,
    precision: Annotated[Optional[PrecisionChoice], train_option(
        "Autocast precision; auto: bf16 on GPUs and CPUs with bf16 instructions, else fp32; fp16 (GPU) uses "
        "a dynamic loss scale (default: auto).",
        DEVICES)] = None,
    nproc: Annotated[Optional[int], train_option(
        "Spawn N local worker processes (one per GPU; gloo on CPU). Under torchrun, leave it out (default: 1).",
        DEVICES)] = None,
    save_interval_updates: Annotated[Optional[int], train_option(
        "Also save checkpoint_{epoch}_{update}.pt and checkpoint_last.pt every N updates "
        "(default 0: at epoch ends only).",
        CHECKPOINTS)] = None,
    keep_last_epochs: Annotated[Optional[int], train_option(
        "Keep only the newest N checkpoint{epoch}.pt (default -1: all).", CHECKPOINTS)] = None,
    keep_interval_updates: Annotated[Optional[int], train_option(
        "Keep only the newest N checkpoint_{epoch}_{update}.pt (default -1: all).", CHECKPOINTS)] = None,
    restore_file: Annotated[Optional[str], train_option(
        "Start from this checkpoint when the save dir has no checkpoint_last.pt.", CHECKPOINTS)] = None,
    max_update: Annotated[Optional[int], train_option("Stop after N updates (default 0: no limit).", STOPPING)] = None,
    max_epoch: Annotated[Optional[int], train_option("Stop after N epochs (default 0: no limit).", STOPPING)] = None,
    max_time: Annotated[Optional[str], train_option(
        "Stop after this much training time over all runs: 90m, 12h, 1:30:00 or seconds.", STOPPING)] = None,
    patience: Annotated[Optional[int], train_option(
        "Stop after N validations without a better validation loss (default 0: off).", STOPPING)] = None,
    validate_interval_updates: Annotated[Optional[int], train_option(
        "Also validate every N updates (default 0: at epoch ends only).", REPORTING)] = None,
    eval_bleu: Annotated[Optional[bool], train_option(
        "Also compute BLEU on the validation set (beam search, sacrebleu).", REPORTING,
        "--eval-bleu/--no-eval-bleu")] = None,
    eval_bleu_beam: Annotated[Optional[int], train_option("Beam size for --eval-bleu (default: 2).", REPORTING)] = None,
    log_interval: Annotated[Optional[int], train_option(
        "A log line every N updates (default: 100).", REPORTING)] = None,
    tensorboard_dir: Annotated[Optional[str], train_option(
        "Write TensorBoard scalars here (needs the tensorboard package).", REPORTING)] = None,
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Train a model on a preprocessed data directory; re-running the same command resumes.

    Several GPUs on one machine: --nproc N. Several machines: torchrun --nnodes M --nproc-per-node N
    --rdzv-endpoint HOST:PORT -m nmt train ... (each process takes its share of every batch list).
    """
    options = dict(locals())  # every parameter but these is a TrainConfig field of the same name
    common(verbose, quiet, log_format)
    from nmt.models.registry import parse_overrides
    from nmt.training.config import load_train_config
    from nmt.training.trainer import train as run_training

    for name in ("config", "model_set", "verbose", "quiet", "log_format"):
        options.pop(name)
    if precision is not None:
        options["precision"] = PrecisionChoice(precision).value
    run_training(load_train_config(options, config, parse_overrides(model_set)))


class LenpenStyleChoice(str, Enum):
    gnmt = "gnmt"
    fairseq = "fairseq"


class OutputFormatChoice(str, Enum):
    plain = "plain"
    fairseq = "fairseq"


class QuantizeChoice(str, Enum):
    none = "none"
    int8 = "int8"


SEARCH = "Search"


@app.command()
def generate(
    data: Annotated[Optional[str], typer.Argument(
        metavar="[DATA_DIR]", show_default=False, help="Data directory from `nmt preprocess` (or use --input).")] = None,
    path: Annotated[str, typer.Option(help="Checkpoint to translate with.")] = "checkpoints/checkpoint_best.pt",
    split: Annotated[str, typer.Option(help="Split of DATA_DIR to translate.")] = "test",
    input: Annotated[Optional[str], typer.Option(
        "--input", "-i", help="Raw source text instead of DATA_DIR, one sentence a line ('-' = stdin).")] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Write here (atomically) instead of stdout.")] = None,
    beam: Annotated[int, typer.Option(help="Beam size (1 = greedy).", rich_help_panel=SEARCH)] = 4,
    lenpen: Annotated[float, typer.Option(help="Length penalty alpha.", rich_help_panel=SEARCH)] = 0.6,
    lenpen_style: Annotated[LenpenStyleChoice, typer.Option(
        help="gnmt: score / ((5+|Y|)/6)^alpha (the paper's); fairseq: score / |Y|^alpha.",
        rich_help_panel=SEARCH)] = LenpenStyleChoice.gnmt,
    max_len_a: Annotated[float, typer.Option(help="Max output length = a * source length + b.",
                                             rich_help_panel=SEARCH)] = 1.0,
    max_len_b: Annotated[int, typer.Option(help="See --max-len-a.", rich_help_panel=SEARCH)] = 50,
    min_len: Annotated[int, typer.Option(help="Min output length (EOS excluded).", rich_help_panel=SEARCH)] = 1,
    no_repeat_ngram_size: Annotated[int, typer.Option(help="Never repeat an n-gram of this size (0 = off).",
                                                      rich_help_panel=SEARCH)] = 0,
    nbest: Annotated[int, typer.Option(help="Hypotheses to output per sentence.", rich_help_panel=SEARCH)] = 1,
    sampling: Annotated[bool, typer.Option(help="Sample instead of searching.", rich_help_panel=SEARCH)] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.", rich_help_panel=SEARCH)] = 1.0,
    topk: Annotated[int, typer.Option(help="Sample from the k likeliest tokens (0 = all).", rich_help_panel=SEARCH)] = 0,
    topp: Annotated[float, typer.Option(help="Nucleus sampling mass (0 = off).", rich_help_panel=SEARCH)] = 0.0,
    seed: Annotated[int, typer.Option(help="Random seed for sampling.", rich_help_panel=SEARCH)] = 1,
    format: Annotated[OutputFormatChoice, typer.Option(
        help="plain: one translation per line; fairseq: S-/T-/H-/D-/P- lines.")] = OutputFormatChoice.plain,
    print_scores: Annotated[bool, typer.Option(help="Plain format: prefix each line with its score and a tab.")] = False,
    max_tokens: Annotated[Optional[int], typer.Option(help="Source tokens x beam per batch.")] = 8000,
    batch_size: Annotated[Optional[int], typer.Option(help="Sentences per batch at most.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto (the GPU when there is one).")] = "cpu",
    precision: Annotated[PrecisionChoice, typer.Option(
        help="Autocast precision; auto: bf16 where the hardware has it, else fp32.")] = PrecisionChoice.auto,
    quantize: Annotated[QuantizeChoice, typer.Option(
        help="CPU only: int8 dynamic quantization of the nn.Linear layers (the tied output projection stays fp32)."
        )] = QuantizeChoice.none,
    score_reference: Annotated[bool, typer.Option(
        help="Print BLEU (on stderr) against the split's raw reference file, or its target side if that is gone.")] = False,
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Translate a binarized split or raw text with beam search (defaults: the paper's beam 4, alpha 0.6).

    Output: one line per input line (--nbest K: K lines), in input order; an empty input line gives an
    empty translation.
    """
    options = dict(locals())
    common(verbose, quiet, log_format)
    from nmt.generation.generator import GenerateOptions, generate as run_generation

    for name in ("verbose", "quiet", "log_format"):
        options.pop(name)
    options = {key: value.value if isinstance(value, Enum) else value for key, value in options.items()}
    result = run_generation(GenerateOptions(**options, progress=not quiet))
    for metric in result.scores:  # stderr: stdout holds only translations
        typer.echo(metric.formatted, err=True)


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe with preprocess/train/average/generate/score sections.")],
    stages: Annotated[str, typer.Option(help="Comma-separated stages to run.")] =
        "preprocess,train,average,generate,score",
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Run a recipe's whole pipeline: preprocess -> train -> average -> generate -> score."""
    common(verbose, quiet, log_format)
    from rich.console import Console

    from nmt.pipeline import run_recipe

    report = run_recipe(recipe, tuple(stage.strip() for stage in stages.split(",") if stage.strip()))
    Console(stderr=True).print(report.table())
    for result in report.scores:
        typer.echo(result.formatted)


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the demo writes its data, model and translations.")] =
        Path("nmt-demo"),
    max_update: Annotated[int, typer.Option(min=1, help="Training updates.")] = 300,
    max_time: Annotated[str, typer.Option(help="Training time limit, a safety net on a slow or busy machine.")] = "10m",
    verbose: Verbose = 0, quiet: Quiet = False, log_format: LogFormat = LogFormatChoice.text,
) -> None:
    """Train and evaluate on an embedded toy task (numbers in words, EN->DE) on the CPU: no download."""
    common(verbose, quiet, log_format)
    from rich.console import Console

    from nmt.demo import run_demo

    report = run_demo(workdir, max_update, max_time)
    console = Console(stderr=True)
    console.print(report.table())
    for result in report.scores:
        typer.echo(result.formatted)
    typer.echo(f"data: {report.data}  model: {report.model}  translations: {report.translations}")


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
