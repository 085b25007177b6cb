"""nmt run and nmt demo's recipe: every stage wired to the next."""

from pathlib import Path

import pytest
import yaml
from conftest import MULTI30K, run_cli, run_nmt

import nmt.training.decoding_check as decoding_check
from nmt.checkpoint.format import load_checkpoint
from nmt.confinement import Confinement
from nmt.data.preprocess import PreprocessOptions, preprocess
from nmt.demo import demo_recipe
from nmt.demo_data import write_demo_corpus
from nmt.errors import NmtError
from nmt.generation.decoding_settings import RECORD_KEY, DecodingSettings, decoding_settings
from nmt.generation.options import CheckSearchOptions
from nmt.models.registry import get_arch
from nmt.options import build
from nmt.pipeline import plan_recipe, run_recipe


def tiny_recipe(tmp_path, raw) -> dict:
    recipe = demo_recipe(tmp_path, raw, max_update=12, max_time="5m")
    recipe["preprocess"].update(vocab_size=150, byte_fallback=False)  # no room for 256 byte pieces
    recipe["model"] = {"d_model": 32, "ffn_dim": 64}
    recipe["train"].update(save_interval_updates=4, validate_interval_updates=0, max_tokens=1024,
                           warmup_updates=5, max_epoch=0)
    recipe["average"]["num_update_checkpoints"] = 2
    recipe["generate"].update(beam=2, max_len_b=8)
    return recipe


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pipeline")
    raw = write_demo_corpus(tmp_path / "raw", train_size=300, valid_size=20, test_size=20, seed=3)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path, raw)), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:  # so that the 20-sentence validation split is still checked
        patch.setattr(decoding_check, "MIN_CHECK_SENTENCES", 20)
        return tmp_path, path, run_recipe(path)


@pytest.mark.slow
def test_every_stage_runs_and_feeds_the_next(pipeline_run):
    tmp_path, _, report = pipeline_run
    assert list(report.seconds) == ["preprocess", "train", "average", "generate", "score"]
    averaged = load_checkpoint(report.model)
    names = [p.rsplit("/", 1)[-1] for p in averaged["averaged_from"]]
    assert len(names) == 2 and names[0].endswith("_8.pt") and names[1].endswith("_12.pt")  # the last two updates
    assert RECORD_KEY in averaged  # generate's model has its decoding check; checkpoint_best.pt, unused, has none
    assert RECORD_KEY not in load_checkpoint(tmp_path / "checkpoints" / "checkpoint_best.pt")
    assert len(report.translations.read_text(encoding="utf-8").splitlines()) == 20
    assert [r.name for r in report.scores] == ["BLEU", "chrF2"]


@pytest.mark.slow
def test_stages_can_be_rerun_alone_without_the_training_text(pipeline_run):
    tmp_path, path, _ = pipeline_run
    train = sorted((tmp_path / "raw").glob("train.*"))
    for file in train:  # archived once preprocessed: generate and score read only the test split's text
        file.rename(file.with_name("archived-" + file.name))
    try:
        report = run_recipe(path, ("generate", "score"))
    finally:
        for file in train:
            file.with_name("archived-" + file.name).rename(file)
    assert list(report.seconds) == ["generate", "score"]


@pytest.mark.slow
def test_the_generate_stage_takes_the_choice_of_the_check_of_its_search(pipeline_run):
    """The recipe generates with beam 2 and max_len_b 8, not generate's defaults: the average stage's
    check judged that search, so --stop auto takes its choice (not exact, for a search it did not run)."""
    _, path, report = pipeline_run
    generate = plan_recipe(path, ("generate",)).generate
    record = DecodingSettings.from_dict(load_checkpoint(report.model)[RECORD_KEY])
    assert record.search == generate.search.checked()
    settings = decoding_settings(generate.compute, generate.search, generate.path)
    assert settings.stop == record.stop and "stop exact: this search has" not in settings.reason


def test_the_decoding_check_judges_the_generate_stages_search(tmp_path):
    raw = write_demo_corpus(tmp_path / "raw", train_size=20, valid_size=5, test_size=5, seed=3)
    recipe, path = tiny_recipe(tmp_path, raw), tmp_path / "recipe.yaml"
    recipe["generate"]["lenpen"] = 1.4
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    generated = CheckSearchOptions(check_beam=2, check_lenpen=1.4, check_max_len_b=8)
    assert plan_recipe(path).average.check_search == generated
    recipe["average"]["check_lenpen"] = 1.0  # a section's own choice stays
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert plan_recipe(path).average.check_search.check_lenpen == 1.0
    del recipe["average"]
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert plan_recipe(path).train.check_search == generated  # training's end checks checkpoint_best.pt
    recipe["generate"]["lenpen"] = "long"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    with pytest.raises(NmtError, match="`generate: lenpen`"):
        plan_recipe(path)


@pytest.mark.slow
def test_models_trained_side_by_side_are_averaged_each_and_decoded_as_an_ensemble(tmp_path):
    raw = write_demo_corpus(tmp_path / "raw", train_size=60, valid_size=20, test_size=5, seed=3)
    recipe, path = tiny_recipe(tmp_path, raw), tmp_path / "recipe.yaml"
    recipe["train"].update(models=2, threads=2)
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    members = [tmp_path / "checkpoints" / "model1", tmp_path / "checkpoints" / "model2"]
    averages = [member / "averaged.pt" for member in members]
    plan = plan_recipe(path)
    assert [options.inputs for options in plan.averages] == [[str(member)] for member in members]
    assert plan.generate.path == [f"{averages[0]}:{averages[1]}"]
    assert f"- {averages[1]}" in plan.describe()  # --dry-run shows each model's average
    with pytest.MonkeyPatch.context() as patch:  # so that the 20-sentence validation split is still checked
        patch.setattr(decoding_check, "MIN_CHECK_SENTENCES", 20)
        report = run_recipe(path)
    assert report.results["train"].startswith("model 1: 12 updates") and "; model 2: 12 updates" in \
        report.results["train"]
    for member, average in zip(members, averages):
        averaged = load_checkpoint(average)
        assert [Path(name).parent for name in averaged["averaged_from"]] == [member, member]
        assert RECORD_KEY in averaged  # each model's decoding check
    assert not (tmp_path / "checkpoints" / "averaged.pt").exists()
    assert len(report.translations.read_text(encoding="utf-8").splitlines()) == 5
    ensemble = run_nmt("generate", tmp_path / "data-bin", "--path", f"{averages[0]}:{averages[1]}",
                       "--split", "test", "--beam", 2, "--max-len-b", 8, "--quiet")
    assert ensemble.returncode == 0, ensemble.stderr
    assert report.translations.read_text(encoding="utf-8") == ensemble.stdout


def test_training_leaves_the_decoding_check_to_an_average_stage(tmp_path):
    raw = write_demo_corpus(tmp_path / "raw", train_size=20, valid_size=5, test_size=5, seed=3)
    recipe, path = tiny_recipe(tmp_path, raw), tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert not plan_recipe(path).train.check_decoding
    recipe["train"]["check_decoding"] = True
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert plan_recipe(path).train.check_decoding
    del recipe["average"], recipe["train"]["check_decoding"]
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    assert plan_recipe(path).train.check_decoding  # generate translates with checkpoint_best.pt


def test_the_check_covers_archived_training_text_and_a_reference_outside_the_corpus(tmp_path):
    raw = write_demo_corpus(tmp_path / "raw", train_size=20, valid_size=5, test_size=5, seed=3)
    recipe = tiny_recipe(tmp_path, raw)
    for name in ("train.en", "train.de"):
        (tmp_path / "raw" / name).unlink()  # archived once preprocessed
    path = tmp_path / "recipe.yaml"
    recipe["generate"]["output"] = str(tmp_path / "raw" / "train.en")
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "averaged.pt").touch()  # what the generate stage alone translates with
    with pytest.raises(NmtError, match="is also the raw text of preprocess"):
        plan_recipe(path, ("generate",))
    (tmp_path / "ref.de").write_text("a reference\n")
    recipe["generate"]["output"] = str(tmp_path / "ref.de")
    recipe["score"]["ref"] = [str(tmp_path / "ref.de")]
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    with pytest.raises(NmtError, match="is also the score: reference"):
        plan_recipe(path, ("generate", "score"))
    assert (tmp_path / "ref.de").read_text() == "a reference\n"


@pytest.mark.parametrize("section, key, target", [("generate", "output", "raw/test.de"),
                                                  ("generate", "output", "raw/train.en"),
                                                  ("average", "output", "checkpoints/checkpoint_last.pt")])
def test_a_recipe_writing_over_its_inputs_fails_its_check(tmp_path, section, key, target):
    raw = write_demo_corpus(tmp_path / "raw", train_size=20, valid_size=5, test_size=5, seed=3)
    recipe = tiny_recipe(tmp_path, raw)
    recipe[section][key] = str(tmp_path / target)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    before = {file: file.read_bytes() for file in (tmp_path / "raw").iterdir()}
    with pytest.raises(NmtError, match="is also the raw text|has the name of a training checkpoint"):
        plan_recipe(path)
    assert {file: file.read_bytes() for file in (tmp_path / "raw").iterdir()} == before


def test_unknown_sections_and_stages_are_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("", encoding="utf-8")
    with pytest.raises(NmtError, match="is empty"):
        run_recipe(path)
    path.write_text("trian: {}\n", encoding="utf-8")
    with pytest.raises(NmtError, match="unknown section"):
        run_recipe(path)
    path.write_text("train: {}\n", encoding="utf-8")
    with pytest.raises(NmtError, match="unknown stage"):
        run_recipe(path, ("preprocess", "evaluate"))


@pytest.mark.slow
def test_cli_missing_recipe_is_one_line(tmp_path):
    result = run_nmt("run", tmp_path / "none.yaml")
    assert result.returncode == 1 and "recipe not found" in result.stderr and "Traceback" not in result.stderr


def test_train_config_takes_the_recipes_data_dir(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """`nmt train --config RECIPE`, as recipes/README.md documents it: the data dir is preprocess's destdir."""
    save_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "preprocess": {"source_lang": "en", "target_lang": "de", "trainpref": "raw/train",
                       "destdir": str(tiny_data_dir)},
        "arch": "transformer_tiny", "model": {"dropout": 0.0},
        "train": {"save_dir": str(save_dir), "max_update": 1, "max_tokens": 1000, "device": "cpu"}}))
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", recipe, "--seed", "5", "--input-dir",
                           tiny_data_dir, "-q")
    assert code == 0, err
    written = yaml.safe_load((save_dir / "config.yaml").read_text())
    assert written["train"]["data"] == str(tiny_data_dir) and written["train"]["seed"] == 5
    assert written["model"]["dropout"] == 0.0
    assert load_checkpoint(save_dir / "checkpoint_last.pt")["train_config"] == written


@pytest.mark.slow
def test_the_multi30k_recipe_starts(tmp_path):
    """The shipped recipe as it is, but for where it reads and writes and a budget of 2 updates:
    its vocabulary, arch, model and training settings preprocess the corpus and train."""
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (the shared data directory is absent)")
    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "multi30k_en_de.yaml").read_text())
    for split, prefix in (("trainpref", "train"), ("validpref", "val"), ("testpref", "test_2016_flickr")):
        recipe["preprocess"][split] = str(MULTI30K / prefix)
    recipe["preprocess"]["destdir"] = str(tmp_path / "data-bin")
    recipe["train"].update(save_dir=str(tmp_path / "checkpoints"), max_update=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")

    report = run_recipe(path, ("preprocess", "train"), Confinement(input_dirs=(str(MULTI30K),)))

    assert report.results["train"].startswith("2 updates")
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_last.pt")
    run_config = checkpoint["train_config"]
    arch = get_arch(recipe["arch"])
    expected_dropout = recipe.get("model", {}).get("dropout", arch.config.dropout)  # the recipe's, else the arch's
    assert run_config["arch"] == recipe["arch"] and run_config["model"]["dropout"] == expected_dropout
    assert run_config["train"]["lr"] == recipe["train"]["lr"]
    assert run_config["train"]["precision"] in ("fp32", "bf16")  # `auto`, resolved and stored


def test_a_recipe_run_from_another_directory_says_where_its_relative_paths_were_read(tmp_path, monkeypatch):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump({"preprocess": {"source_lang": "en", "target_lang": "de",
                                                     "trainpref": "corpus/train", "destdir": "data-bin"}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(NmtError, match=r"corpus/train\.en \(nor corpus/train\.en\.gz\).*relative paths are read "
                                       rf"from the working directory {elsewhere}"):
        plan_recipe(recipe)


def test_an_average_older_than_its_checkpoints_is_a_warning(tmp_path, messages):
    import os

    from nmt.pipeline import warn_if_older_than_its_checkpoints

    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    for name, age in (("checkpoint_1_2.pt", 30), ("averaged.pt", 20), ("checkpoint_1_4.pt", 10)):
        (save_dir / name).write_bytes(b"x")
        os.utime(save_dir / name, (1_000_000 - age, 1_000_000 - age))
    warn_if_older_than_its_checkpoints(save_dir / "averaged.pt", [str(save_dir)])
    assert messages == [f"{save_dir / 'averaged.pt'} is older than 1 checkpoint(s) of its save dir (checkpoint_1_4.pt, "
                        "...): it was averaged before them; run the average stage to translate with them"]
    os.utime(save_dir / "averaged.pt")  # now the newest
    warn_if_older_than_its_checkpoints(save_dir / "averaged.pt", [str(save_dir)])
    assert len(messages) == 1



def test_a_recipe_on_an_existing_data_directory_scores_against_the_text_its_meta_json_records(tmp_path):
    raw = write_demo_corpus(tmp_path / "raw", train_size=300, valid_size=20, test_size=20, seed=3)
    made = tiny_recipe(tmp_path, raw)
    preprocess(build(PreprocessOptions, made.pop("preprocess")), show_progress=False)
    made["data"] = str(tmp_path / "data-bin")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(made), encoding="utf-8")
    plan = plan_recipe(path, ("train", "average", "generate", "score"))
    assert plan.score.ref == [str(Path(f"{raw['test']}.de").resolve())] and plan.score.metric.language == "de"
