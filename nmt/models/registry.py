"""The one model registry every command reads.

A *model* is an ``nn.Module`` class with a ``config_class`` (a frozen dataclass of its
hyper-parameters); an *arch* is a named instance of that dataclass. ``train`` builds from an
arch name plus overrides, checkpoints store the model name and the resolved config, and
``generate``/``average`` rebuild from the checkpoint alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from nmt.errors import NmtError

MODELS: dict[str, type[nn.Module]] = {}


@dataclass(frozen=True)
class Arch:
    name: str
    model_name: str
    config: Any


ARCHS: dict[str, Arch] = {}


def register_model(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        if not dataclasses.is_dataclass(getattr(cls, "config_class", None)):
            raise TypeError(f"model {name!r} needs a dataclass `config_class` attribute")
        cls.model_name = name
        MODELS[name] = cls
        return cls

    return decorate


def register_arch(model_name: str, arch_name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Decorate a zero-argument function that returns the arch's config dataclass."""

    def decorate(make_config: Callable[[], Any]) -> Callable[[], Any]:
        if model_name not in MODELS:
            raise ValueError(f"arch {arch_name!r} names unknown model {model_name!r}")
        if arch_name in ARCHS:
            raise ValueError(f"arch {arch_name!r} is already registered")
        config = make_config()
        if not isinstance(config, MODELS[model_name].config_class):
            raise TypeError(f"arch {arch_name!r} must return a {MODELS[model_name].config_class.__name__}")
        ARCHS[arch_name] = Arch(arch_name, model_name, config)
        return make_config

    return decorate


def _ensure_builtin_models_loaded() -> None:
    import nmt.models.transformer  # noqa: F401  (registers the transformer archs)


def get_arch(name: str) -> Arch:
    _ensure_builtin_models_loaded()
    if name not in ARCHS:
        close = difflib.get_close_matches(name, ARCHS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise NmtError(f"unknown arch {name!r}{hint}; known: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def get_model_class(name: str) -> type[nn.Module]:
    _ensure_builtin_models_loaded()
    if name not in MODELS:
        raise NmtError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def coerce(value: Any, field_type: Any, field_name: str) -> Any:
    """Turn a CLI string or YAML value into a dataclass field's type (Optional, tuples, Literals, dicts)."""
    if isinstance(field_type, str):
        field_type = {"int": int, "float": float, "bool": bool, "str": str}.get(field_type, field_type)
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
    if origin is dict:
        if not isinstance(value, Mapping):
            raise NmtError(f"{field_name} expects a mapping of key: value, got {value!r}")
        return dict(value)
    if field_type is float and isinstance(value, str):
        value = value.strip()  # PyYAML reads 1e-9 (no dot) as a string; float() takes it
    if origin is typing.Literal:
        if value not in args:
            raise NmtError(f"{field_name} must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
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
        if field_type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return field_type(value)
    except (TypeError, ValueError):
        raise NmtError(f"{field_name} expects {getattr(field_type, '__name__', field_type)}, got {value!r}") from None


def resolve_config(config: Any, overrides: Mapping[str, Any]) -> Any:
    """Return a copy of an arch config with fields overridden (values may be strings)."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    changes = {}
    for key, value in overrides.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise NmtError(f"unknown model option {key!r}{hint}; known: {', '.join(fields)}")
        changes[key] = coerce(value, typing.get_type_hints(type(config)).get(key, fields[key].type), key)
    resolved = dataclasses.replace(config, **changes)
    validate = getattr(resolved, "validate", None)
    if validate is not None:
        validate()
    return resolved


def parse_overrides(pairs: list[str] | None) -> dict[str, str]:
    """Parse repeated ``--set key=value`` options."""
    overrides: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise NmtError(f"--set expects key=value, got {pair!r}")
        overrides[key.strip()] = value.strip()
    return overrides


def build_model(model_name: str, config: Any, src_vocab_size: int, tgt_vocab_size: int, pad_id: int) -> nn.Module:
    return get_model_class(model_name)(config, src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
                                       pad_id=pad_id)


def config_from_dict(model_name: str, values: Mapping[str, Any]) -> Any:
    """Rebuild a resolved config stored in a checkpoint (fields unknown to this version are an error)."""
    config_class = get_model_class(model_name).config_class
    return resolve_config(config_class(), values)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters: a tied weight counts once."""
    return sum(p.numel() for p in model.parameters())
