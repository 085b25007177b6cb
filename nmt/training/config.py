"""The options of ``nmt train``: one dataclass whose field names are the CLI options and YAML keys.

``nmt train --config RECIPE`` reads the recipe's ``train:`` section, its top-level ``arch:`` and
``model:`` (``model:`` maps hyper-parameters to override, like ``--set``) and its data directory
(top-level ``data:`` or ``preprocess: {destdir}``); see nmt/recipe.py::

    arch: transformer_base
    model: {dropout: 0.1}
    train:
      max_tokens: 25000
      update_freq: 8
      save_dir: checkpoints/wmt16

Precedence: an option given on the command line > the recipe > the dataclass default. The
resolved configuration is written to ``{save_dir}/config.yaml`` in the same schema, so it can be
passed back as ``--config``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from nmt.confinement import Confinement, foreign_save_dir, foreign_training_files, path_values
from nmt.device_options import DeviceOptions
from nmt.errors import NmtError
from nmt.files import atomic_write
from nmt.generation.options import CheckSearchOptions
from nmt.options import build, check_values, flag, flat_values, merge
from nmt.recipe import data_key, read_document, train_values
from nmt.scoring import AUTO, LOWERCASE_HELP, TOKENIZE_HELP, BleuTokenizer

BATCHING, OPTIM, DEVICES, CHECKPOINTS, STOPPING, REPORTING = (
    "Batching", "Optimisation", "Devices", "Checkpoints", "Stopping", "Validation and logging")


def subset_names(valid_subset: str | None) -> list[str]:
    """``--valid-subset``'s comma-separated split names (also as a checkpoint stores it), in order."""
    return [name.strip() for name in (valid_subset or "").split(",") if name.strip()]


@dataclass
class TrainConfig:
    data: str | None = field(default=None, metadata={"path": True,
        "help": "Data directory written by `nmt preprocess`.", "argument": True, "metavar": "DATA_DIR"})
    arch: str = field(default="transformer_base", metadata={"help": "Architecture from `nmt archs`."})
    model: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "Override a model hyper-parameter of the arch, e.g. --set dropout=0.2 (repeatable).",
        "flags": ["--set"], "metavar": "KEY=VALUE"})
    save_dir: str = field(default="checkpoints", metadata={"path": True, "help": "Checkpoint directory.",
                                                           "panel": CHECKPOINTS})

    # Batching: padded tokens per batch (source or target side, whichever is longer).
    max_tokens: int | None = field(default=4096, metadata={
        "help": "Tokens per batch, padding included (the paper: 25000).", "panel": BATCHING, "min": 1})
    max_sentences: int | None = field(default=None, metadata={
        "help": "Sentences per batch at most.", "panel": BATCHING, "min": 1})
    required_batch_size_multiple: int = field(default=8, metadata={
        "help": "Round batch sizes down to a multiple of this (tensor cores).", "panel": BATCHING, "min": 1})
    update_freq: int = field(default=1, metadata={
        "help": "Accumulate gradients over N batches per update (N times more GPUs).", "panel": BATCHING, "min": 1})
    skip_invalid_size_inputs: bool = field(default=False, metadata={
        "help": "Skip training pairs longer than --max-tokens or the model's max_positions, and validation pairs "
                "longer than max_positions (with a count), instead of stopping.", "panel": BATCHING})
    prefetch: int = field(default=4, metadata={
        "help": "Updates prepared ahead by a background thread (0: none).", "panel": BATCHING, "min": 0})
    train_subset: str = field(default="train", metadata={"help": "Split to train on.", "panel": BATCHING})
    valid_subset: str | None = field(default="valid", metadata={
        "help": "Split(s) to validate on, comma-separated (valid,valid1): the first decides checkpoint_best.pt and "
                "--patience; none: no validation.", "panel": BATCHING})

    # Optimisation, the paper's defaults.
    lr: float | None = field(default=None, metadata={
        "help": "Peak learning rate (fairseq's form, e.g. 7e-4); without it, the paper's d_model^-0.5 formula.",
        "panel": OPTIM, "above": 0})
    warmup_updates: int = field(default=4000, metadata={"help": "Linear warm-up updates.", "panel": OPTIM, "min": 1})
    warmup_share: float = field(default=0.0, metadata={
        "help": "Warm up over this share of the budget (--max-update or --max-time, whichever runs out first) "
                "instead of --warmup-updates, so that a fast and a slow machine follow the same curve; with "
                "--lr-schedule linear or cosine (0: off).", "panel": OPTIM, "min": 0.0, "below": 1.0})
    lr_schedule: Literal["inverse_sqrt", "linear", "cosine"] = field(default="inverse_sqrt", metadata={
        "help": "After the warm-up: inverse_sqrt (the paper's), or linear/cosine decay from the peak to 0 at the "
                "end of --max-update or --max-time (the share of either spent after the warm-up).", "panel": OPTIM})
    adam_betas: tuple[float, float] = field(default=(0.9, 0.98), metadata={
        "help": "Adam betas, e.g. '0.9,0.98'.", "panel": OPTIM, "min": 0.0, "below": 1.0})
    adam_eps: float = field(default=1e-9, metadata={"help": "Adam epsilon.", "panel": OPTIM, "min": 0.0})
    weight_decay: float = field(default=0.0, metadata={
        "help": "Decoupled weight decay (AdamW).", "panel": OPTIM, "min": 0.0})
    clip_norm: float = field(default=0.0, metadata={
        "help": "Clip the gradient norm to this (0: off).", "panel": OPTIM, "min": 0.0})
    label_smoothing: float = field(default=0.1, metadata={
        "help": "Label smoothing epsilon.", "panel": OPTIM, "min": 0.0, "below": 1.0})
    rdrop_alpha: float = field(default=0.0, metadata={
        "help": "R-Drop (Liang et al., 2021): each batch goes through the model twice (one batch of twice the rows, "
                "so two dropout masks) and the loss adds alpha/4 times the two output distributions' symmetric KL "
                "divergence; fairseq's --rdrop-alpha. Up to twice the time and memory of an update (lower "
                "--max-tokens if it runs out), and the training loss logged includes the divergence (0: off).",
        "panel": OPTIM, "min": 0.0})
    seed: int = field(default=1, metadata={
        "help": "Random seed: initialisation, batch order, dropout.", "panel": OPTIM, "min": 0})
    models: int = field(default=1, metadata={
        "help": "Train N models side by side, to decode as an ensemble: seeds --seed, --seed + 1, ..., each in "
                "SAVE_DIR/model1 ... SAVE_DIR/modelN, in a process of its own with its share of the threads and "
                "the whole --max-time. A recipe's average stage then averages each model's checkpoints and "
                "generate decodes the averages together (docs/translating.md).", "panel": OPTIM, "min": 1})

    # Devices.
    compute: DeviceOptions = field(default_factory=DeviceOptions, metadata={"help": "Device options.",
                                                                            "panel": DEVICES})
    nproc: int = field(default=1, metadata={
        "help": "Spawn N local worker processes (one per GPU; gloo on CPU). Under torchrun, leave it out.",
        "panel": DEVICES, "min": 1})
    cpu_processes: int | None = field(default=None, metadata={
        "help": "On a CPU, train in N processes (gloo) sharing the threads, each batch --max-tokens / N so that an "
                "update keeps its size. Unset: as many as leave each batch at least 2,048 tokens and the longest pair "
                "the model takes, up to one per thread, sharing the threads evenly (docs/performance.md: the "
                "speed); 1: one process on all threads. Ignored on a GPU and under torchrun.",
        "panel": DEVICES, "min": 1})

    # Checkpoints.
    save_interval_updates: int = field(default=0, metadata={
        "help": "Also save checkpoint_{epoch}_{update}.pt and checkpoint_last.pt every N updates (0: at epoch ends "
                "only).", "panel": CHECKPOINTS, "min": 0})
    keep_last_epochs: int = field(default=-1, metadata={
        "help": "Keep only the newest N checkpoint{epoch}.pt (-1: all).", "panel": CHECKPOINTS, "min": -1})
    keep_interval_updates: int = field(default=-1, metadata={
        "help": "Keep only the newest N checkpoint_{epoch}_{update}.pt (-1: all).", "panel": CHECKPOINTS, "min": -1})
    restore_file: str | None = field(default=None, metadata={"path": True,
        "help": "Start from this checkpoint when the save dir has no checkpoint_last.pt.", "panel": CHECKPOINTS})
    finetune_from_model: str | None = field(default=None, metadata={"path": True,
        "help": "Start a new run from this checkpoint's weights only (update 0, a fresh optimizer and schedule) when "
                "the save dir has no checkpoint_last.pt: fine-tuning. Not with --restore-file.", "panel": CHECKPOINTS})

    check_decoding: bool = field(default=True, metadata={
        "help": "At the end, find on the first validation split which faster decoding settings (int8, --stop "
                "finished or current) keep checkpoint_best.pt's BLEU, and record them in it for `nmt generate`'s "
                "--quantize auto and --stop auto (`nmt average` checks its output alike); the log gives its seconds.",
        "panel": CHECKPOINTS})
    check_search: CheckSearchOptions = field(default_factory=CheckSearchOptions, metadata={
        "help": "The search the decoding check judges (a recipe's: its generate stage's).", "panel": CHECKPOINTS})

    # Stopping (0 / None: no limit).
    max_update: int = field(default=0, metadata={
        "help": "Stop after N updates (0: no limit).", "panel": STOPPING, "min": 0})
    max_epoch: int = field(default=0, metadata={
        "help": "Stop after N epochs (0: no limit).", "panel": STOPPING, "min": 0})
    max_time: str | None = field(default=None, metadata={
        "help": "Stop after this much training time over all runs: 90m, 12h, 1:30:00 or seconds.", "panel": STOPPING})
    patience: int = field(default=0, metadata={
        "help": "Stop after N validations without a better --best-checkpoint-metric (0: off).", "panel": STOPPING,
        "min": 0})

    # Validation and logging.
    validate_interval_updates: int = field(default=0, metadata={
        "help": "Also validate every N updates (0: at epoch ends only).", "panel": REPORTING, "min": 0})
    eval_bleu: bool = field(default=False, metadata={
        "help": "Also compute BLEU on the validation set (beam search, sacrebleu).", "panel": REPORTING})
    eval_bleu_beam: int = field(default=2, metadata={
        "help": "Beam size for --eval-bleu.", "panel": REPORTING, "min": 1})
    eval_bleu_tokenize: BleuTokenizer = field(default=AUTO, metadata={"help": TOKENIZE_HELP, "panel": REPORTING})
    eval_bleu_lowercase: bool = field(default=False, metadata={"help": LOWERCASE_HELP, "panel": REPORTING})
    best_checkpoint_metric: Literal["loss", "bleu"] = field(default="loss", metadata={
        "help": "What makes checkpoint_best.pt and counts --patience: validation loss (lower is better) or "
                "BLEU (higher is better; needs --eval-bleu).", "panel": REPORTING})
    log_interval: int = field(default=100, metadata={
        "help": "A log line every N updates.", "panel": REPORTING, "min": 1})
    tensorboard_dir: str | None = field(default=None, metadata={"path": True,
        "help": "Write TensorBoard scalars here (needs the tensorboard package).", "panel": REPORTING})

    def __post_init__(self) -> None:
        check_values(self)
        if self.best_checkpoint_metric == "bleu" and not self.eval_bleu:
            raise NmtError("--best-checkpoint-metric bleu needs --eval-bleu")
        if not self.valid_subsets and (needs := self.needs_validation()):
            raise NmtError(f"{flag(needs)} needs validation, and --valid-subset is none")
        if self.max_tokens is None and self.max_sentences is None:
            raise NmtError("give --max-tokens or --max-sentences")
        if self.models > 1 and (self.nproc > 1 or self.cpu_processes is not None):
            raise NmtError("--models trains each model in one process of its own, on its share of the threads: leave "
                           "out --nproc and --cpu-processes (or train the models one after another, with --seed and "
                           "--save-dir)")
        if self.compute.threads is not None and self.compute.threads < self.models:
            raise NmtError(f"--models {self.models} on --threads {self.compute.threads}: each model needs one; give "
                           "more --threads or fewer models")
        if self.cpu_processes is not None and self.nproc > 1:
            raise NmtError("give --nproc (processes, one per GPU) or --cpu-processes (processes on a CPU), not both")
        self.max_time_seconds  # noqa: B018  (parses, or raises a clear error)
        if self.restore_file is not None and self.finetune_from_model is not None:
            raise NmtError("give --restore-file (resume a run's whole state) or --finetune-from-model (its weights "
                           "only), not both")
        if self.warmup_share and self.lr_schedule == "inverse_sqrt":
            raise NmtError("--warmup-share is a share of the budget: give --lr-schedule linear or cosine (and "
                           "--max-update or --max-time)")
        if self.lr_schedule != "inverse_sqrt" and not self.max_update and self.max_time is None:
            raise NmtError(f"--lr-schedule {self.lr_schedule} decays to 0 at the end of the budget: give "
                           "--max-update or --max-time")

    def needs_validation(self) -> str | None:
        """The name of the first option given that only acts at validation (it would silently do
        nothing without)."""
        return next((name for name in ("eval_bleu", "patience", "validate_interval_updates") if getattr(self, name)),
                    None)

    @property
    def valid_subsets(self) -> list[str]:
        """The splits to validate on, the deciding one first."""
        return subset_names(self.valid_subset)

    @property
    def max_time_seconds(self) -> float | None:
        return None if self.max_time is None else parse_duration(self.max_time)


def parse_duration(text: str) -> float:
    """Seconds from "45s", "90m", "12h", "2d", "1:30:00" (h:m:s) or a plain number of seconds."""
    text = str(text).strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if ":" in text:
            seconds = 0.0
            for part in text.split(":"):
                seconds = seconds * 60 + float(part)
        elif text and text[-1].lower() in units:
            seconds = float(text[:-1]) * units[text[-1].lower()]
        else:
            seconds = float(text)
    except ValueError:
        raise NmtError(f"--max-time expects a duration such as 90m, 12h or 1:30:00, got {text!r}") from None
    if not 0 < seconds < math.inf:
        raise NmtError(f"--max-time must be positive and finite, got {text!r}")
    return seconds


def load_train_config(cli_values: Mapping[str, Any] | None = None, config_file: str | Path | None = None,
                      confinement: Confinement | None = None) -> TrainConfig:
    """Merge the command line's given options over the recipe over the defaults.

    A ``model`` mapping (``--set``) is merged key by key over the recipe's ``model:``. With a
    ``confinement`` (`nmt train` gives one; a program's own file needs none), the paths the
    recipe gives (not those the command line overrides) stay within it, and a save dir from the
    command line (or the default) is refused where it holds files of training's names that are not
    an nmt run's, which training would replace (unless ``--allow-outside``).
    """
    document = read_document(config_file, "config file") if config_file is not None else {}
    recipe = train_values(document, config_file) if config_file is not None else {}
    config = build(TrainConfig, merge(recipe, cli_values or {}), "train", str(config_file or "the command line"))
    from_file = {key for key in recipe if key not in (cli_values or {})}
    if confinement is not None and not confinement.allow_outside and "save_dir" not in from_file and \
            (foreign := foreign_training_files(config.save_dir, Path(config_file) if config_file else None)):
        default = "" if "save_dir" in (cli_values or {}) else " (the default)"
        raise foreign_save_dir(f"--save-dir {config.save_dir}{default}", foreign, "choose another --save-dir",
                               "give --allow-outside to train into it anyway")
    if config_file is not None and confinement is not None:
        paths = {key: value for key, value in path_values(config).items() if key in from_file and value is not None}
        outputs = {f"train: {key}": paths.pop(key) for key in ("save_dir", "tensorboard_dir") if key in paths}
        inputs = {data_key(document, "train") if key == "data" else f"train: {key}": value
                  for key, value in paths.items()}
        confinement.check(Path(config_file), outputs, inputs,
                          what="config file", command="nmt train", save_dir=outputs.get("train: save_dir"))
    return config


def config_to_dict(config: TrainConfig, model_config: Any | None = None) -> dict[str, Any]:
    """The recipe schema (arch, model, train); with the resolved model config when given."""
    train = flat_values(config)  # the recipe's flat keys: composed options (device, precision) included
    arch, model = train.pop("arch"), train.pop("model")
    if model_config is not None:
        model = dataclasses.asdict(model_config)
    return {"arch": arch, "model": model, "train": train}


def write_config(path: str | Path, config: TrainConfig, model_config: Any | None = None) -> None:
    with atomic_write(path) as handle:
        yaml.safe_dump(config_to_dict(config, model_config), handle, sort_keys=False, allow_unicode=True)
