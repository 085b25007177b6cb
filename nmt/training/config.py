"""The options of ``nmt train``: one dataclass whose field names are the CLI options and YAML keys.

A recipe is a YAML file; train reads its ``train:`` section (keys = TrainConfig fields) and the
top-level ``arch:`` and ``model:`` keys (``model:`` maps model hyper-parameters to override, like
``--set``). Other top-level sections (``preprocess:``, ``generate:``, ...) belong to other commands
and are ignored here::

    arch: transformer_base
    model: {dropout: 0.1}
    train:
      max_tokens: 25000
      update_freq: 8
      warmup_updates: 4000
      save_dir: checkpoints/wmt16

Precedence: an option given on the command line > the recipe > the dataclass default. The
resolved configuration is written to ``{save_dir}/config.yaml`` in the same schema, so it can be
passed back as ``--config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from nmt.device import Precision
from nmt.errors import NmtError
from nmt.files import atomic_write, read_yaml_mapping
from nmt.models.registry import coerce


@dataclass
class TrainConfig:
    data: str | None = None  # the data directory written by `nmt preprocess`
    arch: str = "transformer_base"
    model: dict[str, Any] = field(default_factory=dict)  # model hyper-parameters overriding the arch's
    save_dir: str = "checkpoints"

    # Batching: padded tokens per batch (source or target side, whichever is longer).
    max_tokens: int | None = 4096
    max_sentences: int | None = None
    required_batch_size_multiple: int = 8
    update_freq: int = 1  # batches accumulated into one update (per process)
    skip_invalid_size_inputs: bool = False  # drop training pairs longer than max_tokens instead of failing
    prefetch: int = 4  # updates prepared ahead by a background thread (0: in the training loop)
    train_subset: str = "train"
    valid_subset: str | None = "valid"  # None: no validation

    # Optimisation, the paper's defaults.
    lr: float | None = None  # peak learning rate (fairseq's form); None: the paper's d_model^-0.5 formula
    lr_scheduler: Literal["inverse_sqrt"] = "inverse_sqrt"
    warmup_updates: int = 4000
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # decoupled (AdamW), as fairseq's Adam
    clip_norm: float = 0.0  # 0: no clipping
    label_smoothing: float = 0.1
    seed: int = 1

    # Devices.
    device: str = "auto"  # auto (cuda when available), cpu, cuda
    precision: Precision = "auto"  # auto: bf16 where the hardware has it, else fp32 (nmt.device)
    nproc: int = 1  # local worker processes to spawn (one per GPU; gloo on CPU)

    # Checkpoints.
    save_interval_updates: int = 0  # also save every N updates (0: only at epoch ends)
    keep_last_epochs: int = -1  # keep only the newest N checkpoint{epoch}.pt (-1: all)
    keep_interval_updates: int = -1  # keep only the newest N checkpoint_{epoch}_{update}.pt (-1: all)
    restore_file: str | None = None  # start from this checkpoint when save_dir has no checkpoint_last.pt

    # Stopping (0 / None: no limit).
    max_update: int = 0
    max_epoch: int = 0
    max_time: str | None = None  # wall clock: "90m", "12h", "1:30:00" or seconds
    patience: int = 0  # stop after N validations without a better validation loss

    # Validation and logging.
    validate_interval_updates: int = 0  # also validate every N updates (always at epoch ends)
    eval_bleu: bool = False  # also BLEU of the validation set, translated with a short beam
    eval_bleu_beam: int = 2
    log_interval: int = 100
    tensorboard_dir: str | None = None

    def validate(self) -> None:
        if not self.data:
            raise NmtError("give the data directory (DATA_DIR, or `data:` in the recipe's train section)")
        if self.max_tokens is None and self.max_sentences is None:
            raise NmtError("give --max-tokens or --max-sentences")
        at_least = {"max_tokens": 1, "max_sentences": 1, "required_batch_size_multiple": 1, "update_freq": 1,
                    "prefetch": 0, "warmup_updates": 1, "nproc": 1, "save_interval_updates": 0,
                    "keep_last_epochs": -1, "keep_interval_updates": -1, "max_update": 0, "max_epoch": 0,
                    "patience": 0, "validate_interval_updates": 0, "eval_bleu_beam": 1, "log_interval": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise NmtError(f"--{option(name)} must be at least {low}, got {value}")
        if self.lr is not None and self.lr <= 0:
            raise NmtError(f"--lr must be positive, got {self.lr}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise NmtError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if not all(0.0 <= beta < 1.0 for beta in self.adam_betas):
            raise NmtError(f"--adam-betas must be in [0, 1), got {self.adam_betas}")
        for name in ("adam_eps", "weight_decay", "clip_norm"):
            if getattr(self, name) < 0:
                raise NmtError(f"--{option(name)} must not be negative, got {getattr(self, name)}")
        self.max_time_seconds  # noqa: B018  (parses, or raises a clear error)

    @property
    def max_time_seconds(self) -> float | None:
        return None if self.max_time is None else parse_duration(self.max_time)


def option(name: str) -> str:
    return name.replace("_", "-")


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
    if seconds <= 0:
        raise NmtError(f"--max-time must be positive, got {text!r}")
    return seconds


FIELDS = typing.get_type_hints(TrainConfig)  # name -> type (the dataclass stores them as strings)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The train-related part of a recipe: the ``train:`` section plus top-level arch and model."""
    document = read_yaml_mapping(path, "config file")
    section = document.get("train") or {}
    if not isinstance(section, dict):
        raise NmtError(f"{path}: the `train:` section must be a mapping of option: value")
    values = dict(section)
    for key in ("arch", "model"):
        if key in document:
            if key in section and section[key] != document[key]:
                raise NmtError(f"{path} gives `{key}` both at the top level and in `train:`; keep one")
            values[key] = document[key]
    return values


def check_keys(values: Mapping[str, Any], where: str) -> None:
    for key in values:
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise NmtError(f"unknown train option {key!r} in {where}{hint}")


def load_train_config(cli_values: Mapping[str, Any] | None = None, config_file: str | Path | None = None,
                      model_overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Merge the command line's given options (None = not given) over the recipe over the defaults.

    ``model_overrides`` (``--set``) are merged key by key over the recipe's ``model:`` mapping.
    """
    recipe = read_recipe(config_file) if config_file is not None else {}
    check_keys(recipe, str(config_file))
    given = {key: value for key, value in (cli_values or {}).items() if value is not None}
    check_keys(given, "the command line")
    values = {**recipe, **given}
    values["model"] = {**coerce(recipe.get("model") or {}, FIELDS["model"], "model"),
                       **(model_overrides or {})}
    config = TrainConfig(**{key: coerce(value, FIELDS[key], key) for key, value in values.items()})
    config.validate()
    return config


def config_to_dict(config: TrainConfig, model_config: Any | None = None) -> dict[str, Any]:
    """The recipe schema (arch, model, train); with the resolved model config when given."""
    train = dataclasses.asdict(config)
    arch, model = train.pop("arch"), train.pop("model")
    train["adam_betas"] = list(train["adam_betas"])
    if model_config is not None:
        model = dataclasses.asdict(model_config)
    return {"arch": arch, "model": model, "train": train}


def write_config(path: str | Path, config: TrainConfig, model_config: Any | None = None) -> None:
    with atomic_write(path) as handle:
        yaml.safe_dump(config_to_dict(config, model_config), handle, sort_keys=False, allow_unicode=True)
