"""Training's guards against traps: stale temp files, silent corruption, spent time, --nproc
without GPUs, logs that stay machine-readable."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_training_trainer import tiny_config

from nmt.checkpoint.format import load_checkpoint
from nmt.cli import main
from nmt.device import resolve_device
from nmt.errors import NmtError
from nmt.log import logger, setup_logging
from nmt.training.distributed import processes_for_this_machine
from nmt.training.trainer import train


def test_stale_temp_files_of_a_killed_save_are_removed_and_reported(tiny_data_dir, tmp_path, messages):
    stale = [tmp_path / ".checkpoint_last.pt.k1ll3d.tmp", tmp_path / ".checkpoint_1_3.pt.abc123.tmp"]
    for path in stale:
        path.write_bytes(b"\0" * 1000)
    kept = tmp_path / ".notes.tmp"  # not a name nmt writes: left alone
    kept.write_text("mine")
    train(tiny_config(tiny_data_dir, tmp_path, max_update=1))
    assert not any(path.exists() for path in stale) and kept.exists()
    assert any("removed 2 stale temp file(s)" in m for m in messages)


def test_resume_skips_a_checkpoint_whose_tensors_were_silently_damaged(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=4, save_interval_updates=2))
    last = tmp_path / "checkpoint_last.pt"
    checkpoint = torch.load(last, weights_only=True)
    first_state = next(iter(checkpoint["optimizer"]["state"].values()))
    first_state["exp_avg"].view(-1)[:100] = 1234.5  # Adam's state, as a bad disk would flip it; the zip is fine
    torch.save(checkpoint, last)
    summary = train(tiny_config(tiny_data_dir, tmp_path, max_update=5, save_interval_updates=2))
    log = "\n".join(messages)
    assert "its 'optimizer' entry does not match its checksum" in log
    assert "instead of the broken checkpoint_last.pt" in log and "epoch 1, update 4" in log  # the newest that verifies
    assert summary.updates == 5


def test_max_time_already_spent_is_nothing_to_do(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=2))
    written = (tmp_path / "config.yaml").read_text()
    summary = train(tiny_config(tiny_data_dir, tmp_path, max_update=10, max_time="0.001"))
    assert summary.updates == 2 and summary.stop_reason == "reached --max-time 0.001"
    last = tmp_path / "checkpoint_last.pt"
    assert f"nothing to do: reached --max-time 0.001 (a larger limit trains on from {last})" in messages
    assert load_checkpoint(tmp_path / "checkpoint_last.pt")["train_state"]["update"] == 2
    assert (tmp_path / "config.yaml").read_text() == written  # not the options of a run that trained nothing


def test_nproc_without_gpus_is_one_process_with_the_same_update_size(tiny_data_dir, tmp_path, messages,
                                                                      monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = processes_for_this_machine(tiny_config(tiny_data_dir, tmp_path, nproc=4, update_freq=2, device="auto"),
                                        resolve_device("auto"), 1024)
    assert config.nproc == 1 and config.update_freq == 8
    assert any("--nproc 4 with --device auto and no GPU: training in 1 process with --update-freq 8" in m
               for m in messages)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    config = processes_for_this_machine(tiny_config(tiny_data_dir, tmp_path, nproc=4, device="cpu"),
                                        resolve_device("cpu"), 1024)
    assert config.nproc == 4 and any("--nproc 4 CPU processes on 2 core(s)" in m for m in messages)


@pytest.mark.parametrize("threads,max_tokens,max_positions,asked,expected", [
    (2, 4096, 1024, None, (2, 4096 // 2)),  # the CPU recipe on two cores: two processes of 2,048 tokens
    (8, 4096, 1024, None, (2, 2048)),  # no batch below 2,048 tokens
    (8, 25000, 1024, None, (8, 3125)),  # up to one process per thread
    (1, 4096, 1024, None, (1, 4096)),
    (2, 4000, 1024, None, (1, 4000)),
    (4, 8192, 4096, None, (2, 4096)),  # each batch holds the longest pair the model takes
    (4, 6144, 1024, None, (2, 3072)),  # the threads shared evenly: not 3 processes on 4 threads
    (3, 4096, 1024, None, (1, 4096)),
    (2, 4096, 1024, 1, (1, 4096)),  # --cpu-processes 1: one process on all threads
    (2, 1000, 1024, 2, (2, 500)),  # asked for: as given
])
def test_a_cpu_trains_in_processes_that_keep_the_update_size(tiny_data_dir, tmp_path, messages, threads, max_tokens,
                                                             max_positions, asked, expected):
    config = tiny_config(tiny_data_dir, tmp_path, threads=threads, max_tokens=max_tokens, update_freq=3,
                         max_sentences=100, cpu_processes=asked)
    laid_out = processes_for_this_machine(config, resolve_device("cpu"), max_positions)
    assert (laid_out.nproc, laid_out.max_tokens) == expected
    assert laid_out.update_freq == 3 and laid_out.max_sentences == 100 // expected[0]
    if expected[0] > 1:
        assert f"training in {expected[0]} CPU processes (gloo) of {max(1, threads // expected[0])} thread(s)" \
            in messages[-1]
        assert laid_out.compute.threads == threads  # shared by the processes (train_process), whatever OMP says


def test_processes_on_a_cpu_are_for_a_cpu(tiny_data_dir, tmp_path, monkeypatch):
    config = tiny_config(tiny_data_dir, tmp_path, threads=2, max_tokens=4096)
    assert processes_for_this_machine(config, torch.device("cuda"), 1024) == config  # one process per GPU: --nproc
    with pytest.raises(NmtError, match="--cpu-processes 4 would leave each process batches of no token"):
        processes_for_this_machine(tiny_config(tiny_data_dir, tmp_path, max_tokens=3, cpu_processes=4),
                                   resolve_device("cpu"), 1024)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert processes_for_this_machine(config, resolve_device("cpu"), 1024) == config  # torchrun chose the processes
    with pytest.raises(NmtError, match="--nproc .* or --cpu-processes .* not both"):
        tiny_config(tiny_data_dir, tmp_path, nproc=2, cpu_processes=2)


def test_the_layout_sees_the_models_positions(tiny_data_dir, tmp_path, monkeypatch):
    seen = []

    def layout(config, device, max_positions):
        seen.append(max_positions)
        raise NmtError("laid out")

    monkeypatch.setattr("nmt.training.trainer.processes_for_this_machine", layout)
    with pytest.raises(NmtError, match="laid out"):
        train(tiny_config(tiny_data_dir, tmp_path, model={"max_positions": 300}))
    assert seen == [300]


def test_json_logs_are_pure_json_lines(tiny_data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["nmt", "train", str(tiny_data_dir), "--arch", "transformer_tiny",
                                     "--max-tokens", "1000", "--max-update", "2", "--save-dir", str(tmp_path),
                                     "--log-format", "json"])
    level = logger.level
    try:
        main()
    except SystemExit as exc:
        assert not exc.code
    finally:
        setup_logging()
        logger.setLevel(level)
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]  # fails on any other line
    summary = [r for r in records if r.get("kind") == "summary"]
    assert len(summary) == 1 and summary[0]["updates"] == 2


def test_log_lines_to_a_file_or_pipe_are_not_wrapped(capsys):
    level = logger.level
    setup_logging()  # stderr is not a terminal under pytest
    try:
        logger.info("x" * 300)
    finally:
        logger.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("x" * 300) and len(lines[0]) < 330


def test_json_logs_end_an_error_in_a_json_line_too(tmp_path):
    result = subprocess.run([sys.executable, "-m", "nmt", "train", str(tmp_path / "nowhere"), "--log-format", "json"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    (record,) = [json.loads(line) for line in result.stderr.splitlines()]  # fails on any other line
    assert record["level"] == "error" and record["message"] == f"data directory not found: {tmp_path / 'nowhere'}"
