"""nmt demo: re-running it in the same directory finds its corpus unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt.demo import demo_recipe, run_demo, write_corpus_if_changed
from nmt.errors import NmtError


def test_a_second_run_leaves_an_unchanged_corpus_untouched(tmp_path):
    first = write_corpus_if_changed(tmp_path / "raw", train_size=200)
    files = {key: path for key, path in first.items() if "." in key}
    stamps = {key: path.stat().st_mtime_ns for key, path in files.items()}
    files["test.de"].write_text("edited\n")
    second = write_corpus_if_changed(tmp_path / "raw", train_size=200)
    assert second == first
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == sorted(p.name for p in files.values())
    for key, path in files.items():  # an unchanged file keeps its mtime too
        assert (path.stat().st_mtime_ns == stamps[key]) == (key != "test.de"), key
    assert files["test.de"].read_text() != "edited\n"  # a changed file is written again


def test_the_demo_has_no_time_limit():
    recipe = demo_recipe(Path("w"), {"train": "t", "valid": "v", "test": "s"}, max_update=300)
    assert recipe["train"]["max_time"] is None
    assert recipe["average"]["num_update_checkpoints"] * recipe["train"]["save_interval_updates"] <= 300


@pytest.mark.parametrize("max_update,expected", [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (7, (2, 3)), (149, (49, 3)),
                                                 (150, (50, 3)), (300, (50, 3)), (1000, (50, 3))])
def test_every_allowed_max_update_leaves_the_checkpoints_the_average_asks_for(max_update, expected):
    recipe = demo_recipe(Path("w"), {"train": "t", "valid": "v", "test": "s"}, max_update=max_update)
    interval, count = recipe["train"]["save_interval_updates"], recipe["average"]["num_update_checkpoints"]
    assert 1 <= count <= recipe["train"]["keep_interval_updates"] and count * interval <= max_update
    assert (interval, count) == expected  # (save interval, checkpoints averaged)


def test_a_workdir_that_cannot_be_a_directory_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(NmtError, match=r"cannot use --workdir .*file: Not a directory"):
        run_demo(tmp_path / "file", max_update=1)
    assert (tmp_path / "file").read_text() == "mine"


def test_resuming_with_another_max_update_is_refused_before_any_work(tmp_path):
    """The tryout's case: stopped at 300, resumed with 80, it failed at averaging (other checkpoints)."""
    (tmp_path / "checkpoints").mkdir(parents=True)
    (tmp_path / "checkpoints" / "config.yaml").write_text("train:\n  max_update: 300\n")
    with pytest.raises(NmtError, match=r"holds a demo run of --max-update 300: resume it with --max-update 300"):
        run_demo(tmp_path, max_update=80)
    assert not (tmp_path / "raw").exists() or not any((tmp_path / "raw").iterdir())
