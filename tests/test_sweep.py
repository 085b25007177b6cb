"""benchmarks/sweep.py: a screening run trains a recipe's variant, decodes val and keeps a CSV row; a
recipe of several models (train: models) is decoded as their ensemble."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_pipeline import tiny_recipe

from nmt.demo_data import write_demo_corpus

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep.py"


@pytest.mark.slow
def test_a_variant_of_two_models_is_trained_side_by_side_and_decoded_as_an_ensemble(tmp_path):
    raw = write_demo_corpus(tmp_path / "raw", train_size=60, valid_size=20, test_size=5, seed=3)
    recipe = tiny_recipe(tmp_path, raw)
    recipe["average"] = {"num_epoch_checkpoints": 1}
    recipe["train"].update(save_interval_updates=0, keep_last_epochs=2, max_epoch=2, max_update=0)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    table = tmp_path / "sweep.csv"
    command = [sys.executable, SCRIPT, "train", "recipe.yaml", "--name", "pair", "--set", "train.models=2", "--set",
               "train.threads=2", "--csv", table]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert b"\r" not in table.read_bytes()  # the line ends of the committed CSV, which runs append to
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 1 and rows[0]["overrides"] == "train.models=2 train.threads=2"
    assert rows[0]["epochs"] == "2/2" and rows[0]["average"] == "1/1"
    assert rows[0]["split"] == "valid" and float(rows[0]["bleu"]) >= 0
    members = [tmp_path / "runs" / "sweep" / "pair" / f"model{index}" for index in (1, 2)]
    assert all((member / "sweep-average1.pt").is_file() for member in members)
    assert (members[0] / "sweep-average1.ensemble-valid-b2-a0.6.hyp").is_file()
