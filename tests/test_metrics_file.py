"""SAVE_DIR/metrics.jsonl: one record per log interval and validation, one history across resumes."""

from __future__ import annotations

import json

from nmt.training.config import load_train_config
from nmt.training.metrics_file import MetricsFile, read_metrics
from nmt.training.trainer import train


def tiny_config(data_dir, save_dir, **options):
    values = {"data": str(data_dir), "arch": "transformer_tiny", "save_dir": str(save_dir), "max_tokens": 1000,
              "lr": 3e-3, "warmup_updates": 10, "log_interval": 2}
    return load_train_config({**values, **options})


def test_training_writes_train_and_valid_records(tiny_data_dir, tmp_path):
    train(tiny_config(tiny_data_dir, tmp_path, max_epoch=2))  # 9 updates per epoch
    records = read_metrics(tmp_path / "metrics.jsonl")
    train_updates = [r["update"] for r in records if r["kind"] == "train"]
    valid_updates = [r["update"] for r in records if r["kind"] == "valid"]
    assert train_updates == [2, 4, 6, 8, 10, 12, 14, 16, 18] and valid_updates == [9, 18]
    assert all({"loss", "lr", "tokens_per_second"} <= r.keys() for r in records if r["kind"] == "train")
    assert all(r["loss"] > 0 for r in records)


def test_resume_continues_one_history(tiny_data_dir, tmp_path):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=9))
    # A run killed after its last checkpoint leaves records (and a torn line) for updates it will replay.
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"kind": "train", "update": 10, "loss": 1.0}) + "\n" + '{"kind": "tr')
    train(tiny_config(tiny_data_dir, tmp_path, max_update=14))
    updates = [r["update"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert updates == [2, 4, 6, 8, 10, 12, 14]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")


def test_append_after_restart_keeps_earlier_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsFile(path, resume_update=0)
    first.append({"kind": "train", "update": 1})
    first.append({"kind": "train", "update": 2})
    MetricsFile(path, resume_update=1).append({"kind": "train", "update": 2, "again": True})
    assert read_metrics(path) == [{"kind": "train", "update": 1}, {"kind": "train", "update": 2, "again": True}]
