"""nmt/options.py: options declared once as dataclass fields, shown by --help, coerced and checked."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest
import typer.rich_utils
from conftest import assert_one_line_error, run_cli, run_nmt
from typer.testing import CliRunner

from nmt.cli import app
from nmt.commands import COMMAND_OPTIONS
from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.options import BatchingOptions, GenerateOptions, SearchOptions
from nmt.options import build, coerce, flag, merge, options_of
from nmt.training.config import TrainConfig, load_train_config


def help_text(monkeypatch, command: str) -> str:
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 1000)  # one line per option
    result = CliRunner().invoke(app, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def shown_default(option) -> str | None:
    """How typer shows a field's default in --help (None: not shown)."""
    value = option.default
    if value is None or value is dataclasses.MISSING or value == {}:
        return None
    if isinstance(value, bool):
        if "flags" in option.metadata:
            return None  # a single on-flag such as --json: off by default
        return option.name.replace("_", "-") if value else "no-" + option.name.replace("_", "-")
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def test_every_command_is_built_from_its_dataclass():
    assert set(COMMAND_OPTIONS) == {"average", "preprocess", "score", "train", "generate", "serve", "plot attention",
                                    "plot curves", "export ctranslate2"}
    assert COMMAND_OPTIONS["generate"] is GenerateOptions


@pytest.mark.parametrize("command", sorted(COMMAND_OPTIONS))
def test_help_shows_every_field_with_its_default_once(monkeypatch, command):
    text = help_text(monkeypatch, command)
    for option in options_of(COMMAND_OPTIONS[command]).values():
        assert not re.search(r"\(default\b|\bdefault:", option.help, re.I), f"{option.name}: help repeats its default"
        name = option.metadata["metavar"] if option.metadata.get("argument") else option.flags[0]
        rows = [line for line in text.splitlines() if name in line.strip("│ ").split()[:2]]
        assert len(rows) == 1, f"--help of {command} does not show {option.name}"
        assert option.help.split(".")[0] in rows[0]
        default = shown_default(option)
        if default is not None:
            assert f"[default: {default}]" in rows[0], (option.name, rows[0])
            assert rows[0].count("[default:") == 1


def test_choices_come_from_the_literal_type(monkeypatch):
    text = help_text(monkeypatch, "generate")
    assert "<gnmt|fairseq>" in text and "<auto|fp32|bf16|fp16>" in text and "<auto|none|int8>" in text


@pytest.mark.parametrize("value,kind,expected", [
    ("5", int, 5), (5.0, int, 5), ("1e-9", float, 1e-9), ("none", int | None, None), ("7", int | None, 7),
    ("(0.9, 0.98)", tuple[float, float], (0.9, 0.98)), ([0.9, 0.99], tuple[float, float], (0.9, 0.99)),
    ("yes", bool, True), ("off", bool, False), ("a.de", list[str], ["a.de"]), ("gnmt", Literal["gnmt", "x"], "gnmt"),
])
def test_coerce(value, kind, expected):
    assert coerce(value, kind, "opt") == expected


@pytest.mark.parametrize("value,kind,message", [
    ("five", int, "opt expects int, got 'five'"), (2.5, int, "expects int"), (True, int, "expects int"),
    ("maybe", bool, "expects bool"), ([1], float, "expects float"), ("fp8", Literal["fp32", "bf16"], "must be one of"),
    ("0.9", tuple[float, float], "expects 2 values"), ("x", dict[str, int], "expects a mapping"),
])
def test_coerce_refuses_with_one_line(value, kind, message):
    with pytest.raises(NmtError, match=message) as error:
        coerce(value, kind, "opt")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("make,message", [
    (lambda: SearchOptions(beam=0), "--beam must be at least 1, got 0"),
    (lambda: SearchOptions(beam=2, nbest=3), "--nbest must be between 1 and --beam (2), got 3"),
    (lambda: SearchOptions(lenpen=6.0), "--lenpen must be between -5.0 and 5.0, got 6.0"),
    (lambda: SearchOptions(sampling=True, temperature=0.0), "--temperature must be above 0.0, got 0.0"),
    (lambda: TrainConfig(label_smoothing=1.0), "--label-smoothing must be at least 0.0 and below 1.0, got 1.0"),
    (lambda: TrainConfig(adam_betas=(0.9, 1.0)), "--adam-betas must be at least 0.0 and below 1.0, got (0.9, 1.0)"),
    (lambda: TrainConfig(lr=0.0), "--lr must be above 0, got 0.0"),
    (lambda: SearchOptions(sampling=True, topp=1.5), "--topp must be between 0.0 and 1.0"),
    (lambda: SearchOptions(sampling=True, topk=-1), "--topk must be at least 0"),
    (lambda: SearchOptions(lenpen_style="other"), "--lenpen-style must be one of gnmt, fairseq"),
    (lambda: BatchingOptions(batch_size=0), "--batch-size must be at least 1, got 0"),
    (lambda: BatchingOptions(max_tokens=-5), "--max-tokens must be at least 0, got -5"),
    (lambda: BatchingOptions(max_tokens=None), "give --max-tokens or --batch-size"),
    (lambda: InferenceDeviceOptions(quantize="int4"), "--quantize must be one of auto, none, int8"),
    (lambda: TrainConfig(warmup_updates=0), "--warmup-updates must be at least 1, got 0"),
])
def test_options_check_their_own_values(make, message):
    with pytest.raises(NmtError) as error:
        make()
    assert str(error.value).startswith(message)


def test_unknown_keys_suggest_the_closest_option():
    with pytest.raises(NmtError, match=r"unknown generate option 'bem' in r.yaml \(did you mean 'beam'\?\)"):
        build(GenerateOptions, {"input": "-", "bem": 5}, "generate", "r.yaml")
    with pytest.raises(NmtError, match=r"unknown generate option 'xyzzy' in r.yaml$"):
        build(GenerateOptions, {"input": "-", "xyzzy": 5}, "generate", "r.yaml")


def test_build_nests_composed_options_under_flat_names():
    options = build(GenerateOptions, {"input": "-", "beam": "5", "max_tokens": "100", "precision": "bf16"})
    assert options.search == SearchOptions(beam=5) and options.batching == BatchingOptions(max_tokens=100)
    assert options.compute.precision == "bf16"
    assert build(GenerateOptions, {"input": "-"}).search == SearchOptions()  # the defaults fill the rest


@dataclass
class Inner:
    beam: int = field(default=1, metadata={"help": "Beam."})


@dataclass
class Outer:
    beam: int = field(default=1, metadata={"help": "Beam again."})
    inner: Inner = field(default_factory=Inner, metadata={"help": "Composed."})


def test_a_name_declared_twice_is_refused():
    with pytest.raises(TypeError, match="'beam' is declared twice"):
        options_of(Outer)


def test_command_line_over_recipe_over_defaults(tmp_path):
    assert merge({"beam": 4, "model": {"dropout": 0.1, "heads": 8}}, {"beam": 5, "model": {"dropout": 0.3}}) == \
        {"beam": 5, "model": {"dropout": 0.3, "heads": 8}}
    recipe = tmp_path / "r.yaml"
    recipe.write_text("preprocess: {destdir: bin}\narch: transformer_tiny\nmodel: {dropout: 0.2}\n"
                      "train: {max_tokens: 100, seed: 3}\n")
    config = load_train_config({"seed": 9, "model": {"heads": "2"}}, recipe)
    assert (config.data, config.arch, config.max_tokens, config.seed) == ("bin", "transformer_tiny", 100, 9)
    assert config.model == {"dropout": 0.2, "heads": "2"} and config.warmup_updates == 4000


def test_flags_are_the_field_names_with_dashes():
    assert flag("max_len_a") == "--max-len-a"
    assert options_of(GenerateOptions)["input"].flags == ("--input", "-i")


@pytest.mark.slow
def test_batch_size_zero_is_an_error_not_a_hang():
    result = run_nmt("generate", "-i", "-", "--batch-size", "0", stdin="five\n", timeout=60)
    assert_one_line_error(result, "--batch-size must be at least 1, got 0")


@pytest.mark.parametrize("args,message", [
    (["--beam", "0"], "--beam must be at least 1, got 0"),
    (["--lenpen", "-9"], "--lenpen must be between -5.0 and 5.0"),
    (["--max-tokens", "-1"], "--max-tokens must be at least 0, got -1"),
    (["--topp", "0.5"], "--topk/--topp only apply with --sampling"),
])
def test_generate_bounds_on_the_command_line(monkeypatch, capsys, args, message):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", *args)
    assert code == 1 and out == ""
    assert_one_line_error(err, message)


def test_a_choice_outside_its_list_names_the_choices(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", "--shortlist", "bogus")
    assert code == 2 and out == ""
    assert_one_line_error(err, "Invalid value for '--shortlist': 'bogus' is not one of 'auto', 'none'.")


def test_set_reaches_the_model_overrides(monkeypatch, capsys, tiny_data_dir, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "train", tiny_data_dir, "--save-dir", tmp_path / "run",
                           "--arch", "transformer_tiny", "--set", "dropuot=0.2")
    assert code == 1 and not (tmp_path / "run" / "checkpoint_last.pt").exists()
    assert_one_line_error(err, "unknown model option 'dropuot' (did you mean 'dropout'?)")
    code, _, err = run_cli(monkeypatch, capsys, "train", tiny_data_dir, "--set", "dropout")
    assert_one_line_error(err, "--set expects key=value, got 'dropout'")


def test_a_misspelt_metadata_key_is_refused_not_dropped():
    from dataclasses import dataclass, field

    from nmt.options import options_of

    @dataclass(frozen=True)
    class Misspelt:
        beam: int = field(default=4, metadata={"help": "Beam.", "mni": 1})

    with pytest.raises(TypeError, match="unknown metadata key"):
        options_of(Misspelt)
