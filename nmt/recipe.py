"""Reading a recipe: one YAML file with a section of options per stage.

    data: DIR                  # optional: the data directory of every stage (default: preprocess.destdir)
    preprocess: {...}          # PreprocessOptions
    arch: NAME                 # plus `model:` overrides of the arch's hyper-parameters
    train: {...}               # TrainConfig (check_beam, ...: generate's, when not given)
    average: {...}             # AverageOptions (input: the train save dir; check_beam, ...: generate's)
    generate: {...}            # GenerateOptions (data, path and output are filled in)
    score: {...}               # ScoreOptions (system and reference are filled in)

Keys are the commands' option names in snake_case. This module only reads the document;
nmt/pipeline.py turns every section into its options dataclass before any stage runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmt.errors import NmtError
from nmt.files import read_yaml_mapping
from nmt.generation.options import CheckSearchOptions, SearchOptions
from nmt.options import build, did_you_mean, options_of

STAGES = ("preprocess", "train", "average", "generate", "score")
TOP_LEVEL = ("data", "arch", "model")


def read_document(path: str | Path, what: str = "recipe") -> dict[str, Any]:
    """The recipe's mapping; unknown or malformed sections are one-line errors."""
    document = read_yaml_mapping(path, what)
    if not document:
        raise NmtError(f"{path} is empty; a recipe has preprocess/train/average/generate/score sections")
    for key, value in document.items():
        if key not in STAGES + TOP_LEVEL:
            raise NmtError(f"{path}: unknown section {key!r}{did_you_mean(str(key), STAGES + TOP_LEVEL)}; "
                           f"known: {', '.join(STAGES + TOP_LEVEL)}")
        if key in STAGES + ("model",) and value is not None and not isinstance(value, dict):
            raise NmtError(f"{path}: the `{key}:` section must be a mapping of option: value")
    return document


def section(document: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A stage's options as written (None when the recipe has no such section)."""
    if name not in document:
        return None
    return dict(document[name] or {})


def data_dir(document: dict[str, Any]) -> str | None:
    """The data directory every stage shares: top-level `data:`, else what `preprocess:` writes."""
    if document.get("data") is not None:
        return str(document["data"])
    preprocess = section(document, "preprocess") or {}
    return None if preprocess.get("destdir") is None else str(preprocess["destdir"])


def data_key(document: dict[str, Any], stage: str) -> str:
    """The key that gives ``stage`` its data directory, to name it as the user wrote it: the stage's own
    `data:`, else the shared one (data_dir's)."""
    if (section(document, stage) or {}).get("data") is not None:
        return f"{stage}: data"
    return "data" if document.get("data") is not None else "preprocess: destdir"


def checked_search(document: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The generate stage's search as the decoding check's options (check_beam, ...), so that the
    check at training's end or after averaging judges the search that generate runs, whose --stop
    auto then takes the check's choice; empty without a `generate:` section."""
    values = section(document, "generate")
    if values is None:
        return {}
    search = {key: value for key, value in values.items() if key in options_of(SearchOptions)}
    return CheckSearchOptions.values_for(build(SearchOptions, search, "generate", str(path)))


def train_values(document: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The train options a recipe gives: its `train:` section plus top-level arch, model and data dir,
    and the decoding check's search (generate's, unless the section names it)."""
    values = {**checked_search(document, path), **(section(document, "train") or {})}
    for key in ("arch", "model"):
        if key in document:
            if key in values and values[key] != document[key]:
                raise NmtError(f"{path} gives `{key}` both at the top level and in `train:`; keep one")
            values[key] = document[key]
    if values.get("data") is None and data_dir(document) is not None:
        values["data"] = data_dir(document)
    return values


def parse_stages(text: str) -> tuple[str, ...]:
    """``--stages preprocess,train``: the stages named (plan_recipe checks the names)."""
    chosen = tuple(stage.strip() for stage in text.split(",") if stage.strip())
    if not chosen:
        raise NmtError(f"--stages names no stage; stages: {', '.join(STAGES)}")
    return chosen
