import dataclasses

import pytest
import yaml

from nmt.errors import NmtError
from nmt.models.registry import get_arch
from nmt.recipe import read_document, train_values
from nmt.training.config import TrainConfig, load_train_config, parse_duration, write_config

RECIPE = """
preprocess:
  vocab_size: 8000
arch: transformer_small
model:
  dropout: 0.2
  heads: 8
train:
  data: data-bin
  max_tokens: 25000
  update_freq: 8
  adam_eps: 1e-9
  adam_betas: [0.9, 0.997]
  lr: 7e-4
generate:
  beam: 4
"""


@pytest.fixture()
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def test_recipe_then_command_line_then_defaults(recipe):
    config = load_train_config({"max_tokens": 2000, "seed": "7", "model": {"dropout": "0.3"}}, recipe)
    assert config.arch == "transformer_small" and config.data == "data-bin"
    assert config.max_tokens == 2000  # given on the command line
    assert config.update_freq == 8  # not given: the recipe's
    assert config.seed == 7 and config.lr == 7e-4 and config.adam_eps == 1e-9  # "1e-9" is a string to PyYAML
    assert config.adam_betas == (0.9, 0.997)
    assert config.model == {"dropout": "0.3", "heads": 8}  # --set merges over the recipe's model mapping
    assert config.warmup_updates == TrainConfig.warmup_updates  # neither: the default


def test_cli_strings_are_coerced():
    config = load_train_config({"data": "d", "adam_betas": "(0.9, 0.98)", "max_sentences": "none",
                                "skip_invalid_size_inputs": "true", "max_time": "1:30:00"})
    assert config.adam_betas == (0.9, 0.98) and config.max_sentences is None and config.skip_invalid_size_inputs
    assert config.max_time_seconds == 5400


def test_written_config_reads_back_the_same(tmp_path, recipe):
    config = load_train_config({"max_time": "2h"}, recipe)
    model_config = dataclasses.replace(get_arch("transformer_small").config, dropout=0.2, heads=8)
    write_config(tmp_path / "config.yaml", config, model_config)
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["model"] == dataclasses.asdict(model_config)
    again = load_train_config({}, tmp_path / "config.yaml")
    assert dataclasses.replace(again, model={}) == dataclasses.replace(config, model={})
    assert train_values(read_document(tmp_path / "config.yaml"), "config.yaml")["model"]["heads"] == 8


@pytest.mark.parametrize("text,message", [
    ("train: {max_tokenz: 10}", "unknown train option 'max_tokenz'.*did you mean 'max_tokens'"),
    ("train: [1, 2]", "must be a mapping"),
    ("train: {max_tokens: many}", "`train: max_tokens` in .* expects int"),
    ("train: {precision: fp8}", "precision` in .* must be one of auto, fp32, bf16, fp16"),
    ("train: {adam_betas: [0.9]}", "adam_betas` in .* expects 2 values"),
    ("train: {data: d, warmup_updates: 0}", "--warmup-updates must be at least 1"),
    ("train: {data: d, max_time: soon}", "--max-time expects a duration"),
    ("train: {data: d, label_smoothing: 1.5}", "--label-smoothing must be at least 0.0 and below 1.0"),
    ("arch: a\ntrain: {arch: b}", "both at the top level and in `train:`"),
    ("train: {max_tokens: 10\n", "not valid YAML at line"),
    ("train:\n  lr: 0.1\n  max_tokens: 10\n  lr: 0.2\n", "at line 4: 'lr' is given twice"),
    ("train: {data: d}\ngenerate: {beam: 4}\ntrain: {lr: 1}\n", "at line 3: 'train' is given twice"),
])
def test_bad_recipes_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(NmtError, match=message) as error:
        load_train_config({}, path)
    assert "\n" not in str(error.value)


def test_training_without_a_data_directory_is_a_one_line_error_before_any_work(tmp_path):
    from nmt.training.trainer import train

    path = tmp_path / "recipe.yaml"
    path.write_text(f"train: {{save_dir: {tmp_path / 'run'}}}")
    with pytest.raises(NmtError, match="give the data directory"):
        train(load_train_config({}, path))
    assert not (tmp_path / "run").exists()


def test_missing_recipe_and_unknown_cli_option(tmp_path):
    with pytest.raises(NmtError, match="config file not found"):
        load_train_config({}, tmp_path / "missing.yaml")
    with pytest.raises(NmtError, match="unknown train option 'beam'"):
        load_train_config({"data": "d", "beam": 4})


def test_durations():
    assert [parse_duration(text) for text in ("45", "45s", "90m", "12h", "2d", "1:00", "1:00:00")] == \
        [45, 45, 5400, 43200, 172800, 60, 3600]
    for text in ("nan", "inf", "0", "-5m", "nanh"):
        with pytest.raises(NmtError, match="--max-time must be positive and finite"):
            parse_duration(text)


@pytest.mark.parametrize("option", ["label_smoothing", "lr", "clip_norm", "adam_eps"])
def test_nan_is_refused_where_it_would_pass_every_bound(option):
    with pytest.raises(NmtError, match="must be a finite number, got nan"):
        load_train_config({"data": "d", option: "nan"})


@pytest.mark.parametrize("option", [{"eval_bleu": True}, {"patience": 2}, {"validate_interval_updates": 5}])
def test_an_option_that_acts_at_validation_needs_validation(tmp_path, option):
    """Without validation it would do nothing, silently: an error before any work."""
    from conftest import make_data_dir, numbers_pairs, tiny_config

    from nmt.training.trainer import train

    with pytest.raises(NmtError, match=f"--{next(iter(option)).replace('_', '-')} needs validation, and "
                                       "--valid-subset is none"):
        TrainConfig(data="data", valid_subset=None, **option)
    data = make_data_dir(tmp_path / "data", {"train": numbers_pairs(30, seed=1)})  # no valid split
    with pytest.raises(NmtError, match="has no 'valid' split, and --.* needs validation"):
        train(tiny_config(data, tmp_path / "run", **option))
    assert not (tmp_path / "run").exists()
    TrainConfig(data="data", valid_subset=None)  # no such option: training without validation is fine
