"""Every recipe section fails the same way, before anything runs: one `error:` line, exit 1, no traceback.

A catalogue: a typo and a wrong type in each section of an otherwise valid recipe, run through the
real CLI; neither the data directory nor the save dir may exist afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from conftest import assert_one_line_error, make_data_dir, numbers_pairs, run_cli, run_nmt

from nmt.confinement import Confinement
from nmt.errors import NmtError
from nmt.pipeline import plan_recipe
from nmt.written import record_written

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture()
def recipe(tmp_path):
    """A valid recipe (a few lines of raw text) and a function writing it with one section changed."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            (raw / f"{split}.{lang}").write_text("one two\nthree four\n", encoding="utf-8")
    document = {
        "preprocess": {"source_lang": "en", "target_lang": "de", "trainpref": str(raw / "train"),
                       "validpref": str(raw / "valid"), "testpref": str(raw / "test"),
                       "destdir": str(tmp_path / "data-bin"), "vocab_size": 60},
        "arch": "transformer_tiny",
        "model": {"d_model": 32, "ffn_dim": 64},
        "train": {"save_dir": str(tmp_path / "checkpoints"), "max_update": 2, "device": "cpu",
                  "save_interval_updates": 1},
        "average": {"num_update_checkpoints": 1},
        "generate": {"beam": 2},
        "score": {"metrics": "bleu"},
    }

    def write(section: str | None = None, key: str | None = None, value=None):
        changed = {name: dict(body) if isinstance(body, dict) else body for name, body in document.items()}
        if section is not None:
            changed[section][key] = value
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(changed), encoding="utf-8")
        return path

    return write


CASES = [  # section, key, value, what the error says
    ("preprocess", "vocab_sise", 100,
     "unknown preprocess option 'vocab_sise' in {recipe} (did you mean 'vocab_size'?)"),
    ("preprocess", "vocab_size", "many", "`preprocess: vocab_size` in {recipe} expects int, got 'many'"),
    ("model", "dropuot", 0.1, "unknown model option 'dropuot' in {recipe} (did you mean 'dropout'?)"),
    ("model", "dropout", "high", "dropout expects float, got 'high'"),
    ("train", "max_tokenz", 100, "unknown train option 'max_tokenz' in {recipe} (did you mean 'max_tokens'?)"),
    ("train", "max_tokens", "many", "`train: max_tokens` in {recipe} expects int, got 'many'"),
    ("average", "num_update_checkpoint", 1, "unknown average option 'num_update_checkpoint' in {recipe} "
                                            "(did you mean 'num_update_checkpoints'?)"),
    ("average", "num_update_checkpoints", "two", "`average: num_update_checkpoints` in {recipe} expects int"),
    ("generate", "bem", 4, "unknown generate option 'bem' in {recipe} (did you mean 'beam'?)"),
    ("preprocess", "trainpref", "missing/train", "missing/train.en"),
    ("generate", "beam", "five", "`generate: beam` in {recipe} expects int, got 'five'"),
    ("score", "metric", "chrf", "unknown score option 'metric' in {recipe} (did you mean 'metrics'?)"),
    ("score", "lowercase", "maybe", "`score: lowercase` in {recipe} expects bool, got 'maybe'"),
    # Values of the right type but out of range, and sections that cannot work.
    ("generate", "batch_size", 0, "{recipe}, `generate:` section: --batch-size must be at least 1, got 0"),
    ("generate", "lenpen", 7, "--lenpen must be between -5.0 and 5.0, got 7"),
    ("train", "warmup_updates", 0, "--warmup-updates must be at least 1, got 0"),
    ("score", "metrics", "blue", "unknown metric blue"),
    ("average", "num_update_checkpoints", None, "the `average:` section needs num_epoch_checkpoints, num_update"),
    # Sections that are each valid but would fail together after training.
    ("train", "keep_interval_updates", 0, "`average:` takes the last 1 update checkpoints but `train: "
                                          "keep_interval_updates: 0` keeps 0"),
    ("train", "save_interval_updates", 0, "`average:` takes update checkpoints, which training saves only with"),
    ("average", "num_epoch_checkpoints", 5, "epoch_share (exactly one)"),
]


@pytest.mark.parametrize("section,key,value,message", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_bad_section_fails_before_anything_runs(recipe, tmp_path, monkeypatch, capsys, section, key, value, message):
    path = recipe(section, key, value)
    code, out, err = run_cli(monkeypatch, capsys, "run", path)
    assert code == 1 and out == ""
    assert_one_line_error(err, message.format(recipe=path))
    assert not (tmp_path / "data-bin").exists() and not (tmp_path / "checkpoints").exists()  # nothing ran


@pytest.mark.parametrize("output", ["recipe.yaml", "data-bin/meta.json"])
def test_translations_never_replace_the_recipe_or_a_data_directorys_file(recipe, tmp_path, monkeypatch, capsys,
                                                                         output):
    path = recipe("generate", "output", str(tmp_path / output))
    make_data_dir(tmp_path / "data-bin", {"train": numbers_pairs(60, seed=0)})  # as the preprocess stage makes it
    code, _, err = run_cli(monkeypatch, capsys, "run", path, "--dry-run")
    assert code == 1
    assert_one_line_error(err, "is also the recipe: writing it would destroy it" if output == "recipe.yaml" else
                          f"is in the data directory {tmp_path / 'data-bin'}: writing it there could destroy its files")


def test_a_stage_asked_for_by_name_needs_its_section(recipe, monkeypatch, capsys):
    path = recipe("score", "metrics", "bleu")
    text = path.read_text(encoding="utf-8")
    path.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(text).items() if k != "average"}),
                    encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "run", path, "--dry-run", "--stages", "average,generate")
    assert code == 1
    assert_one_line_error(err, f"{path}: --stages average: the recipe has no `average:` section")


@pytest.mark.parametrize("text,message", [
    ("generat: {beam: 4}", "unknown section 'generat' (did you mean 'generate'?)"),
    ("generate: [4]", "the `generate:` section must be a mapping"),
    ("arch: transformer_huge\ntrain: {data: d}", "unknown arch 'transformer_huge'"),
    ("train: {}", "the train section needs a data directory"),
    ("score: {}", "the `score:` section needs a `generate:` section"),
])
def test_bad_recipe_structure(tmp_path, monkeypatch, capsys, text, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "run", path, "--dry-run")
    assert code == 1
    assert_one_line_error(err, message)


@pytest.mark.slow
def test_console_script_reports_a_recipe_error_in_one_line(recipe, tmp_path):
    path = recipe("generate", "bem", 4)
    result = run_nmt("run", path)
    assert_one_line_error(result, f"unknown generate option 'bem' in {path}")
    assert not (tmp_path / "data-bin").exists()


def test_dry_run_prints_every_stage_resolved_and_runs_nothing(recipe, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "run", recipe(), "--dry-run")
    assert code == 0, err
    plan = yaml.safe_load(out)
    assert [stage for stage in plan if stage in ("preprocess", "train", "average", "generate", "score")] == \
        ["preprocess", "train", "average", "generate", "score"]
    checkpoints = str(tmp_path / "checkpoints")
    assert plan["train"]["data"] == plan["generate"]["data"] == str(tmp_path / "data-bin")
    assert plan["train"]["model"]["d_model"] == 32 and plan["train"]["model"]["heads"] == 4  # arch + overrides
    assert plan["average"]["inputs"] == [checkpoints]
    assert plan["generate"]["path"] == [plan["average"]["output"]] == [f"{checkpoints}/averaged.pt"]
    assert plan["generate"]["beam"] == 2 and plan["generate"]["max_tokens"] == 0  # flat: search and batching
    assert plan["score"]["system"] == plan["generate"]["output"] == f"{checkpoints}/test.hyp"
    assert plan["score"]["ref"] == [str(tmp_path / "raw" / "test.de")]
    assert not (tmp_path / "data-bin").exists() and not (tmp_path / "checkpoints").exists()


def header_confinement(path: Path) -> Confinement:
    """The places the recipe's header tells its user to name: `nmt run RECIPE --output-dir X --input-dir Y`."""
    command = next(line for line in path.read_text(encoding="utf-8").splitlines() if "nmt run recipes/" in line)
    words = command.split()
    named = {flag: words[words.index(flag) + 1] for flag in ("--output-dir", "--input-dir") if flag in words}
    return Confinement(output_dir=named.get("--output-dir"),
                       input_dirs=(named["--input-dir"],) if "--input-dir" in named else ())


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda path: path.name)
def test_shipped_recipes_are_valid_as_their_header_runs_them(path, monkeypatch):
    monkeypatch.chdir(RECIPES.parent)  # their paths are taken from the checkout's root
    plan = plan_recipe(path.relative_to(RECIPES.parent), ("train", "average", "generate"),  # preprocess and score
                       header_confinement(path))                                             # need the raw corpus
    assert plan.train.data == plan.preprocess.destdir == plan.generate.data  # the data dir is named once


def test_a_recipe_without_validation_cannot_ask_for_patience(recipe):
    """Found when the recipe is read, not after preprocessing."""
    path = recipe("preprocess", "validpref", None)
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document["train"]["patience"] = 3
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    with pytest.raises(NmtError, match="`train:` gives patience, which needs validation: give `preprocess: validpref`"):
        plan_recipe(path)


def test_a_recipe_without_validation_cannot_generate_from_the_best_checkpoint(recipe, monkeypatch, capsys):
    path = recipe("preprocess", "validpref", None)
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    del document["average"]
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    code, out, err = run_cli(monkeypatch, capsys, "run", path)
    assert code == 1 and out == ""
    assert_one_line_error(err, "`generate:` uses checkpoint_best.pt, which training writes only when it validates")
    document["generate"]["path"] = str(path.parent / "elsewhere.pt")  # a model of the user's own: fine
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    plan_recipe(path)


@pytest.mark.parametrize("stages,message", [
    ("preprocess,train,generate", "--stages trains but does not average: `generate:` would translate with"),
    ("generate,score", "averaged.pt, which is not there: run the average stage first"),
])
def test_stages_that_would_translate_with_a_missing_or_stale_model_fail_first(recipe, monkeypatch, capsys, stages,
                                                                                message):
    code, out, err = run_cli(monkeypatch, capsys, "run", recipe(), "--stages", stages)
    assert code == 1 and out == ""
    assert_one_line_error(err, message)


def test_scoring_the_translation_of_an_input_file_needs_its_reference(recipe, tmp_path, monkeypatch, capsys):
    path = recipe("generate", "input", str(tmp_path / "raw" / "valid.en"))
    code, out, err = run_cli(monkeypatch, capsys, "run", path)
    assert code == 1 and out == ""
    assert_one_line_error(err, "not a split of the data: give `score: ref` (its reference)")
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document["score"]["ref"] = [str(tmp_path / "raw" / "valid.de")]
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    assert plan_recipe(path).score.ref == [str(tmp_path / "raw" / "valid.de")]


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A user's home with a file of theirs and a secret, as the working directory; a downloaded recipe's directory."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".bashrc").write_text("the user's\n")
    (home / ".ssh" / "id_ed25519").write_text("secret\n")
    (tmp_path / "downloads").mkdir()
    monkeypatch.chdir(home)
    return home


def write_recipe(path, generate: dict):
    path.write_text(yaml.safe_dump({"generate": {"path": "model.pt", **generate}}), encoding="utf-8")
    return path


def test_a_recipe_run_from_home_does_not_write_there(home, tmp_path, monkeypatch, capsys):
    """The working directory is not a place of the recipe's: the forced prefix would start every line of .bashrc."""
    downloads = tmp_path / "downloads"
    recipe = write_recipe(downloads / "evil.yaml", {"input": str(downloads / "text.en"), "prefix": str(downloads / "p"),
                                                    "output": ".bashrc"})
    code, out, err = run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run")
    assert code == 1 and out == ""
    assert_one_line_error(err, f"`generate: output: .bashrc` ({home / '.bashrc'}) is outside the recipe's directory "
                               f"({downloads}); a recipe writes only there unless you name a directory with `nmt run "
                               "--output-dir DIR` or trust it like code with `--allow-outside`")
    code, _, err = run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run", "--output-dir",
                           str(home), "--input-dir", str(tmp_path / "downloads"))
    assert code == 1  # named as a place, but .bashrc is not a file nmt wrote
    assert_one_line_error(err, "evil.yaml: .bashrc exists and `nmt run` did not write it")
    assert (home / ".bashrc").read_text() == "the user's\n"


def test_a_recipe_replaces_only_the_files_it_wrote(home, monkeypatch, capsys):
    recipe = write_recipe(home / "recipe.yaml", {"input": "text.en", "output": str(home / ".bashrc")})
    code, _, err = run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run")
    assert code == 1
    assert_one_line_error(err, f"{home / '.bashrc'} exists and `nmt run` did not write it; a recipe replaces only its "
                               "own outputs: remove it, choose another path, or trust the recipe like code with "
                               "`--allow-outside`")
    assert run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run", "--allow-outside")[0] == 0
    translations = home / "test.hyp"
    write_recipe(recipe, {"input": "text.en", "output": str(translations)})
    translations.write_text("an earlier run's\n")
    record_written(translations)  # as `nmt run` does after its generate stage
    assert run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run")[0] == 0
    translations.write_text("edited since\n")
    assert run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run")[0] == 1


def test_a_recipe_trains_only_into_a_new_directory_or_one_of_nmt_s_runs(recipe, tmp_path, monkeypatch, capsys):
    """Training replaces config.yaml, appends to metrics.jsonl and prunes checkpoint*.pt in its save dir:
    a directory holding such files of the user's is refused, before anything runs."""
    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    (save_dir / "config.yaml").write_text("the user's own\n", encoding="utf-8")
    path = recipe("preprocess", "vocab_size", 280)  # byte fallback needs 270
    code, _, err = run_cli(monkeypatch, capsys, "run", path, "--stages", "preprocess,train", "--dry-run")
    assert code == 1
    assert_one_line_error(err, f"`train: save_dir: {save_dir}` holds config.yaml, which training would "
                               "replace or append to, and is not a run of nmt's (no config.yaml that its training "
                               "wrote): choose another save_dir, move those files, or trust the recipe like code "
                               "with `--allow-outside`")
    assert (save_dir / "config.yaml").read_text(encoding="utf-8") == "the user's own\n"
    (save_dir / "config.yaml").unlink()
    (save_dir / "checkpoint3.pt").write_bytes(b"another tool's")
    assert run_cli(monkeypatch, capsys, "run", path, "--stages", "preprocess,train", "--dry-run")[0] == 1
    (save_dir / "checkpoint3.pt").unlink()
    (save_dir / "notes.txt").write_text("training touches no file of this name\n", encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "run", path, "--stages", "preprocess,train")
    assert code == 0, err
    assert (save_dir / "checkpoint_last.pt").exists()
    dry_run = ("run", path, "--stages", "preprocess,train", "--dry-run")
    assert run_cli(monkeypatch, capsys, *dry_run)[0] == 0  # nmt's own run: trained into again


def test_a_recipe_reads_only_inside_its_places(home, tmp_path, monkeypatch, capsys):
    """Else it translates the user's secret into its own directory."""
    recipe = write_recipe(tmp_path / "downloads" / "evil.yaml",
                          {"input": str(home / ".ssh" / "id_ed25519"), "path": str(tmp_path / "downloads" / "m.pt"),
                           "output": str(tmp_path / "downloads" / "out.hyp")})
    code, _, err = run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run")
    assert code == 1
    assert_one_line_error(err, f"`generate: input: {home / '.ssh' / 'id_ed25519'}` is outside the recipe's directory "
                               f"({tmp_path / 'downloads'}); a recipe reads only there unless you name a directory "
                               "with `nmt run --input-dir DIR`")
    assert run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run", "--input-dir",
                   str(home / ".ssh"))[0] == 0


def test_training_from_the_command_line_keeps_another_tool_s_files(home, tmp_path, monkeypatch, capsys):
    """A --save-dir (or the default ./checkpoints) holding a config.yaml or metrics.jsonl that nmt's
    training did not write: refused before anything is written, unless --allow-outside."""
    make_data_dir(tmp_path / "data", {"train": numbers_pairs(40, seed=0)})
    save_dir = tmp_path / "theirs"
    save_dir.mkdir()
    (save_dir / "metrics.jsonl").write_text("another tool's\n", encoding="utf-8")
    command = ("train", tmp_path / "data", "--arch", "transformer_tiny", "--device", "cpu", "--valid-subset", "none",
               "--no-check-decoding", "-q", "--max-update")
    code, _, err = run_cli(monkeypatch, capsys, *command, "1", "--save-dir", save_dir)
    assert code == 1
    assert_one_line_error(err, f"--save-dir {save_dir} holds metrics.jsonl, which training would replace or append "
                               "to, and is not a run of nmt's (no config.yaml that its training wrote): choose another "
                               "--save-dir, move those files, or give --allow-outside to train into it anyway")
    assert sorted(path.name for path in save_dir.iterdir()) == ["metrics.jsonl"]
    (home / "checkpoints").mkdir()  # the default save dir, in the working directory
    (home / "checkpoints" / "config.yaml").write_text("the user's own\n", encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, *command, "1")
    assert code == 1
    assert_one_line_error(err, "--save-dir checkpoints (the default) holds config.yaml, which training would replace")
    assert (home / "checkpoints" / "config.yaml").read_text(encoding="utf-8") == "the user's own\n"
    code, _, err = run_cli(monkeypatch, capsys, *command, "1", "--save-dir", save_dir, "--allow-outside")
    assert code == 0, err
    assert (save_dir / "checkpoint_last.pt").exists()
    code, _, err = run_cli(monkeypatch, capsys, *command, "2", "--save-dir", save_dir)
    assert code == 0, err  # nmt's run now: resumed without --allow-outside


@pytest.mark.parametrize("given", ["data", "preprocess: destdir"])
def test_a_shared_data_directory_outside_is_named_by_the_key_that_gave_it(given, home, tmp_path, monkeypatch, capsys):
    """Not as a stage's key (`train: data`), which the user never wrote."""
    outside = str(home / "corpus")
    document = {"data": outside} if given == "data" else \
        {"preprocess": {"source_lang": "en", "target_lang": "de", "trainpref": "train", "destdir": outside}}
    recipe = tmp_path / "downloads" / "r.yaml"
    train = {"max_epoch": 1, "save_dir": str(recipe.parent / "checkpoints")}
    recipe.write_text(yaml.safe_dump({**document, "train": train}), encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "run", recipe, "--stages", "train", "--dry-run")
    assert code == 1
    assert_one_line_error(err, f"`{given}: {outside}` is outside the recipe's directory")


def test_a_path_that_leaves_through_a_symbolic_link_says_so(home, tmp_path, monkeypatch, capsys):
    """`data` beside the recipe, but a link to elsewhere: the message names where it leads."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "text.en").write_text("five\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data").symlink_to(tmp_path / "elsewhere")
    recipe = write_recipe(tmp_path / "mine" / "r.yaml", {"input": "data/text.en", "path": "m.pt", "output": "o.hyp"})
    monkeypatch.chdir(tmp_path / "mine")
    code, _, err = run_cli(monkeypatch, capsys, "run", recipe, "--stages", "generate", "--dry-run")
    assert code == 1
    assert_one_line_error(err, f"`generate: input: data/text.en` (through a symbolic link: "
                               f"{(tmp_path / 'elsewhere' / 'text.en').resolve()}) is outside the recipe's directory")


def test_an_input_dir_that_does_not_exist_is_an_error(home, tmp_path, monkeypatch, capsys):
    """A mistyped --input-dir let nothing through and --dry-run said nothing of it."""
    recipe = write_recipe(tmp_path / "r.yaml", {"input": "text.en", "output": "o.hyp"})
    code, _, err = run_cli(monkeypatch, capsys, "run", recipe, "--dry-run", "--input-dir", str(tmp_path / "nowhere"))
    assert code == 2  # refused by the parser, as every bad option value
    assert_one_line_error(err, f"Invalid value for '--input-dir': dir '{tmp_path / 'nowhere'}' does not exist")


def test_a_train_config_writes_only_inside_its_places(home, tmp_path, monkeypatch, capsys):
    """`nmt train --config` applied no confinement: its save dir (config.yaml, checkpoints) went anywhere."""
    make_data_dir(tmp_path / "downloads" / "data", {"train": numbers_pairs(40, seed=0)})
    config = tmp_path / "downloads" / "train.yaml"
    config.write_text(yaml.safe_dump({"data": str(tmp_path / "downloads" / "data"), "arch": "transformer_tiny",
                                      "train": {"save_dir": str(home), "max_update": 1, "device": "cpu",
                                                "valid_subset": "none"}}), encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", config, "-q")
    assert code == 1
    assert_one_line_error(err, f"`train: save_dir: {home}` is outside the config file's directory "
                               f"({tmp_path / 'downloads'}); a config file writes only there unless you name a "
                               "directory with `nmt train --output-dir DIR`")
    assert sorted(path.name for path in home.iterdir()) == [".bashrc", ".ssh"]
    inside = tmp_path / "downloads" / "run"
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", config, "--save-dir", inside, "-q")  # the user's
    assert code == 0, err
    assert (inside / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("key", ["data", "train: data", "train: restore_file"])
def test_a_train_config_reads_only_inside_its_places(key, home, tmp_path, monkeypatch, capsys):
    """Its inputs too, each named by the key that gave it: else it trains on, or starts from, what the user has."""
    secret = home / ".ssh" / "id_ed25519"
    data = {"data": str(tmp_path / "downloads" / "data")}
    train = {"save_dir": str(tmp_path / "downloads" / "run"), "max_update": 1, "device": "cpu"}
    if key == "data":
        data["data"] = str(secret)
    else:
        train[key.removeprefix("train: ")] = str(secret)
    config = tmp_path / "downloads" / "train.yaml"
    config.write_text(yaml.safe_dump({**data, "arch": "transformer_tiny", "train": train}), encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", config, "-q")
    assert code == 1
    assert_one_line_error(err, f"`{key}: {secret}` is outside the config file's directory ({tmp_path / 'downloads'}); "
                               "a config file reads only there unless you name a directory with `nmt train "
                               "--input-dir DIR`")
    assert not (tmp_path / "downloads" / "run").exists()


def test_a_train_config_trains_only_into_a_new_directory_or_one_of_nmt_s_runs(tmp_path, monkeypatch, capsys):
    make_data_dir(tmp_path / "data", {"train": numbers_pairs(40, seed=0)})
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    (save_dir / "metrics.jsonl").write_text("the user's log\n", encoding="utf-8")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"data": str(tmp_path / "data"), "arch": "transformer_tiny",
                                      "train": {"save_dir": str(save_dir), "max_update": 1, "device": "cpu",
                                                "valid_subset": "none"}}), encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "train", "--config", config, "-q")
    assert code == 1
    assert_one_line_error(err, f"`train: save_dir: {save_dir}` holds metrics.jsonl, which training would replace "
                               "or append to, and is not a run of nmt's (no config.yaml that its training wrote): "
                               "choose another save_dir, move those files, or trust the config file like code")
    assert sorted(path.name for path in save_dir.iterdir()) == ["metrics.jsonl"]
    assert (save_dir / "metrics.jsonl").read_text(encoding="utf-8") == "the user's log\n"
    (save_dir / "config.yaml").unlink(missing_ok=True)
    os.mkfifo(save_dir / "config.yaml")  # a FIFO where the config would be: refused, never read (it would block)
    assert run_cli(monkeypatch, capsys, "train", "--config", config, "-q")[0] == 1


def test_a_config_file_is_never_taken_for_the_config_its_training_writes(tmp_path, monkeypatch, capsys):
    """A `--config` named config.yaml in its own save dir, in the schema training writes: training would replace it."""
    make_data_dir(tmp_path / "data", {"train": numbers_pairs(40, seed=0)})
    project = tmp_path / "project"
    project.mkdir()
    config = project / "config.yaml"
    train = {"save_dir": str(project), "max_update": 1, "device": "cpu", "valid_subset": "none"}
    mine = yaml.safe_dump({"arch": "transformer_tiny", "model": {"d_model": 32}, "train": train})
    config.write_text(mine, encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "train", str(tmp_path / "data"), "--config", config, "-q")
    assert code == 1
    assert_one_line_error(err, f"`train: save_dir: {project}` holds config.yaml, which training would replace "
                               "or append to, and is not a run of nmt's")
    assert config.read_text(encoding="utf-8") == mine
