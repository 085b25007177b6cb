"""Options declared once: a dataclass field is a CLI option, a recipe key and a checked value.

Every command's options are a dataclass whose fields carry their own description::

    beam: int = field(default=4, metadata={"help": "Beam size (1 = greedy).", "min": 1})

``help`` is required; ``min``/``max`` are inclusive bounds, ``above``/``below`` exclusive ones (each
value of a tuple is checked); choices come from a ``Literal`` type;
``panel`` names the rich help panel; ``flags`` gives explicit CLI names (``["--input", "-i"]``);
``argument`` makes the field a positional argument shown as ``metavar``; ``path`` shows a text
option as a file or directory. Any other key is an error (a misspelt ``mni`` would drop a bound). A field whose type is
itself an options dataclass is composed: its fields are options of the outer command too, under
the same names (``GenerateOptions.search.beam`` is ``--beam`` and ``beam:``).

This module reads that metadata for the CLI (nmt/cli.py builds each command from it) and for
recipes: coercion of strings and YAML values to the field's type, unknown keys with a "did you
mean", bounds checks with a one-line error naming the option, and the CLI > recipe > default merge.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Mapping

from nmt.errors import NmtError

COMMAND_LINE = "the command line"
METADATA_KEYS = frozenset({"help", "min", "max", "above", "below", "panel", "flags", "argument", "metavar", "path",
                           "literal"})  # literal: its text as given ("", "none" are values, not "not set")


@dataclass(frozen=True)
class Option:
    """One field of an options dataclass, as the CLI and the recipes see it."""

    name: str  # the field name: the recipe key, and --name-with-dashes on the command line
    type: Any  # the resolved type hint
    default: Any  # dataclasses.MISSING when the option is required
    metadata: Mapping[str, Any]
    owner: tuple[str, ...]  # the composed fields leading to it: ("search",) for GenerateOptions' beam

    @property
    def help(self) -> str:
        return self.metadata["help"]

    @property
    def help_with_bounds(self) -> str:
        bounds = describe_bounds(self.metadata)
        return f"{self.help} ({bounds})" if bounds else self.help

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(self.metadata.get("flags") or (flag(self.name),))

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def describe_bounds(metadata: Mapping[str, Any]) -> str:
    """"1 to 5", "at least 1", "above 0", "at least 0 and below 1", or "" without bounds."""
    low, high = metadata.get("min"), metadata.get("max")
    if low is not None and high is not None:
        return f"{low} to {high}"
    parts = [f"{words} {metadata[key]}" for key, words in (("min", "at least"), ("above", "above"),
                                                            ("max", "at most"), ("below", "below")) if key in metadata]
    return " and ".join(parts)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def is_options_class(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


@cache
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolves the strings that `from __future__ import annotations` leaves


@cache
def options_of(cls: type) -> dict[str, Option]:
    """Every option of ``cls`` by name, composed dataclasses flattened (a name used twice is a bug)."""
    hints = type_hints(cls)
    found: dict[str, Option] = {}
    for spec in dataclasses.fields(cls):
        if "help" not in spec.metadata:
            raise TypeError(f"{cls.__name__}.{spec.name} needs metadata={{'help': ...}}")
        if unknown := set(spec.metadata) - METADATA_KEYS:
            raise TypeError(f"{cls.__name__}.{spec.name}: unknown metadata key(s) {', '.join(sorted(unknown))}")
        kind = hints[spec.name]
        if is_options_class(kind):
            inner = {name: dataclasses.replace(option, owner=(spec.name, *option.owner),
                                               metadata={"panel": spec.metadata.get("panel"), **option.metadata})
                     for name, option in options_of(kind).items()}
        else:
            default = spec.default if spec.default_factory is dataclasses.MISSING else spec.default_factory()
            inner = {spec.name: Option(spec.name, kind, default, spec.metadata, ())}
        for name in inner:
            if name in found:
                raise TypeError(f"{cls.__name__}: option {name!r} is declared twice")
        found.update(inner)
    return found


def did_you_mean(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(values: Mapping[str, Any], known: typing.Iterable[str], what: str, where: str) -> None:
    """``what`` names the options ("generate"), ``where`` their source ("recipe.yaml")."""
    known = list(known)
    for key in values:
        if key not in known:
            raise NmtError(f"unknown {what} option {key!r} in {where}{did_you_mean(str(key), known)}")


def coerce(value: Any, field_type: Any, field_name: str) -> Any:
    """Turn a CLI string or YAML value into a field's type (Optional, tuples, lists, Literals, dicts)."""
    origin, args = typing.get_origin(field_type), typing.get_args(field_type)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in {"none", "null", ""}):
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return coerce(value, inner, field_name)
    if origin is tuple:
        items = [item for item in re.split(r"[\s,()\[\]]+", value) if item] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise NmtError(f"{field_name} expects {len(args)} values such as '0.9,0.98', got {value!r}")
        return tuple(coerce(item, arg, field_name) for item, arg in zip(items, args))
    if origin is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise NmtError(f"{field_name} expects a list, got {value!r}")
        return [coerce(item, args[0], field_name) for item in items]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise NmtError(f"{field_name} expects a mapping of key: value, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in args:
            raise NmtError(f"{field_name} must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if field_type is float and isinstance(value, str):
        value = value.strip()  # PyYAML reads 1e-9 (no dot) as a string; float() takes it
    try:
        if field_type is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in {"1", "true", "yes", "on"}:
                return True
            if text in {"0", "false", "no", "off"}:
                return False
            raise ValueError(value)
        if field_type in (int, float, str) and not isinstance(value, (str, int, float)):
            raise ValueError(value)  # a list or a mapping where one value belongs
        if field_type in (int, float) and isinstance(value, bool):
            raise ValueError(value)  # YAML's `beam: yes` is not a number
        if field_type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return field_type(value)
    except (TypeError, ValueError):
        raise NmtError(f"{field_name} expects {getattr(field_type, '__name__', field_type)}, got {value!r}") from None


def check_values(instance: Any) -> None:
    """Raise a one-line NmtError for the first field outside its bounds or its ``Literal`` choices.

    Options dataclasses call it from ``__post_init__``, so an instance is valid however it was made.
    None is never checked (it means "not set").
    """
    hints = type_hints(type(instance))
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        choices = typing.get_args(hints[spec.name]) if typing.get_origin(hints[spec.name]) is typing.Literal else ()
        if choices and value not in choices:
            raise NmtError(f"{flag(spec.name)} must be one of {', '.join(map(str, choices))}, got {value!r}")
        for number in value if isinstance(value, tuple) else (value,):
            if isinstance(number, float) and not math.isfinite(number):  # nan passes every bound below
                raise NmtError(f"{flag(spec.name)} must be a finite number, got {number}")
            if number is not None and not isinstance(number, (bool, str)) and not within(number, spec.metadata):
                shown = value if isinstance(value, tuple) else number
                raise NmtError(f"{flag(spec.name)} must be {bounds_phrase(spec.metadata)}, got {shown}")


def within(number: Any, metadata: Mapping[str, Any]) -> bool:
    return all(check(number, metadata[key]) for key, check in BOUND_CHECKS.items() if key in metadata)


BOUND_CHECKS = {"min": lambda x, b: x >= b, "max": lambda x, b: x <= b, "above": lambda x, b: x > b,
                "below": lambda x, b: x < b}


def bounds_phrase(metadata: Mapping[str, Any]) -> str:
    bounds = describe_bounds(metadata)
    return f"between {bounds.replace(' to ', ' and ')}" if "min" in metadata and "max" in metadata else bounds


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win (CLI over recipe); a mapping-valued option (``model:``/``--set``) merges key by key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
                value = {**merged[key], **value}
            merged[key] = value
    return merged


def build(cls: type, values: Mapping[str, Any], what: str = "", where: str = COMMAND_LINE) -> Any:
    """An instance of ``cls`` from flat option values (names as in options_of), checked and coerced.

    ``what`` names the options in errors ("generate"), ``where`` their source (a recipe's path). The
    dataclasses check their own values (``__post_init__``); the defaults fill in the rest.
    """
    what = what or cls.__name__
    known = options_of(cls)
    check_keys(values, known, what, where)
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for key, value in values.items():
        option = known[key]
        name = key if where == COMMAND_LINE else f"`{what}: {key}` in {where}"
        literal = option.metadata.get("literal") and isinstance(value, str)
        groups.setdefault(option.owner, {})[key] = value if literal else coerce(value, option.type, name)
    try:
        return _construct(cls, (), groups)
    except NmtError as error:
        if where == COMMAND_LINE:
            raise
        raise NmtError(f"{where}, `{what}:` section: {error}") from None


def _construct(cls: type, owner: tuple[str, ...], groups: dict[tuple[str, ...], dict[str, Any]]) -> Any:
    hints = type_hints(cls)
    kwargs = dict(groups.get(owner, {}))
    for spec in dataclasses.fields(cls):
        if is_options_class(hints[spec.name]):
            path = (*owner, spec.name)
            if any(key[:len(path)] == path for key in groups):
                kwargs[spec.name] = _construct(hints[spec.name], path, groups)
    missing = [flag(spec.name) for spec in dataclasses.fields(cls) if spec.name not in kwargs
               and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING]
    if missing:
        raise NmtError(f"missing option {', '.join(missing)}")
    return cls(**kwargs)


def flat_values(instance: Any) -> dict[str, Any]:
    """The resolved options of an instance by option name (composed dataclasses flattened), for printing."""
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        if dataclasses.is_dataclass(value):
            values.update(flat_values(value))
        else:
            values[spec.name] = list(value) if isinstance(value, tuple) else value
    return values


def parse_overrides(pairs: list[str] | None) -> dict[str, str]:
    """``--set key=value`` options (repeatable) as a mapping: the CLI form of a mapping-valued option."""
    overrides: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise NmtError(f"--set expects key=value, got {pair!r}")
        overrides[key.strip()] = value.strip()
    return overrides
