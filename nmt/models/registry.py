"""The one model registry every command reads.

A *model* is an ``nn.Module`` class with a ``config_class`` (a frozen dataclass of its
hyper-parameters); an *arch* is a named instance of that dataclass. ``train`` builds from an
arch name plus overrides, checkpoints store the model name and the resolved config, and
``generate``/``average`` rebuild from the checkpoint alone.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from nmt.errors import NmtError
from nmt.options import coerce, did_you_mean

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


def get_arch(name: str) -> Arch:
    if name not in ARCHS:
        raise NmtError(f"unknown arch {name!r}{did_you_mean(name, ARCHS)}; known: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def get_model_class(name: str) -> type[nn.Module]:
    if name not in MODELS:
        raise NmtError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def resolve_config(config: Any, overrides: Mapping[str, Any]) -> Any:
    """Return a copy of an arch config with fields overridden (values may be strings)."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    changes = {}
    for key, value in overrides.items():
        if key not in fields:
            raise NmtError(f"unknown model option {key!r}{did_you_mean(key, fields)}; known: {', '.join(fields)}")
        changes[key] = coerce(value, typing.get_type_hints(type(config)).get(key, fields[key].type), key)
    resolved = dataclasses.replace(config, **changes)
    validate = getattr(resolved, "validate", None)
    if validate is not None:
        validate()
    return resolved


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
