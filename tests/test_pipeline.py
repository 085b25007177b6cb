"""nmt run and nmt demo's recipe: every stage wired to the next."""

import subprocess
import sys

import pytest
import yaml

from nmt.checkpoint import load_checkpoint
from nmt.demo import demo_recipe
from nmt.demo_data import write_demo_corpus
from nmt.errors import NmtError
from nmt.pipeline import run_recipe


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
    return tmp_path, path, run_recipe(path)


def test_every_stage_runs_and_feeds_the_next(pipeline_run):
    tmp_path, _, report = pipeline_run
    assert list(report.seconds) == ["preprocess", "train", "average", "generate", "score"]
    averaged = load_checkpoint(report.model)
    names = [p.rsplit("/", 1)[-1] for p in averaged["averaged_from"]]
    assert len(names) == 2 and names[0].endswith("_8.pt") and names[1].endswith("_12.pt")  # the last two updates
    assert len(report.translations.read_text(encoding="utf-8").splitlines()) == 20
    assert [r.name for r in report.scores] == ["BLEU", "chrF2"]


def test_stages_can_be_rerun_alone(pipeline_run):
    _, path, _ = pipeline_run
    report = run_recipe(path, ("generate", "score"))
    assert list(report.seconds) == ["generate", "score"]


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


def test_cli_missing_recipe_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "nmt", "run", str(tmp_path / "none.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "recipe not found" in result.stderr and "Traceback" not in result.stderr
