import dataclasses

import pytest

from nmt.errors import NmtError
from nmt.models.registry import ARCHS, get_arch, register_arch, register_model, resolve_config
from nmt.models.transformer import TransformerConfig
from nmt.options import parse_overrides


def test_builtin_archs_are_registered():
    for name in ("transformer_base", "transformer_big", "transformer_big_en_fr", "transformer_small",
                 "transformer_tiny"):
        assert get_arch(name).model_name == "transformer"


def test_unknown_arch_suggests_a_close_name():
    with pytest.raises(NmtError, match="did you mean 'transformer_base'"):
        get_arch("transformer_bse")


def test_overrides_are_coerced_from_strings():
    config = resolve_config(get_arch("transformer_base").config,
                            parse_overrides(["dropout=0.2", "encoder_layers=4", "normalize_before=true"]))
    assert (config.dropout, config.encoder_layers, config.normalize_before) == (0.2, 4, True)
    assert get_arch("transformer_base").config.dropout == 0.1  # the registered arch is untouched


@pytest.mark.parametrize("pair,message", [
    ("dropuot=0.2", "did you mean 'dropout'"),
    ("dropout=high", "expects float"),
    ("encoder_layers=2.5", "expects int"),
    ("share_embeddings=some", "must be one of"),
    ("heads=7", "divisible"),
    ("dropout=1.5", r"\[0, 1\)"),
])
def test_bad_overrides_are_clear_errors(pair, message):
    with pytest.raises(NmtError, match=message):
        resolve_config(get_arch("transformer_base").config, parse_overrides([pair]))


def test_set_needs_key_value():
    with pytest.raises(NmtError, match="key=value"):
        parse_overrides(["dropout"])


def test_register_arch_rejects_duplicates_and_unknown_models():
    with pytest.raises(ValueError, match="already registered"):
        register_arch("transformer", "transformer_base")(TransformerConfig)
    with pytest.raises(ValueError, match="unknown model"):
        register_arch("no_such_model", "x")(TransformerConfig)


def test_register_model_needs_a_config_dataclass():
    from torch import nn

    with pytest.raises(TypeError, match="config_class"):
        register_model("bad_model")(type("Bad", (nn.Module,), {}))


def test_arch_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ARCHS["transformer_base"].config.dropout = 0.5
