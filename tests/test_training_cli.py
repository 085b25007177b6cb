"""`nmt train` as a user runs it: killed, interrupted, or given bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, assert_same_weights, interrupted_at, run_nmt, tiny_config

from nmt.checkpoint.format import load_checkpoint
from nmt.training.trainer import train

pytestmark = pytest.mark.slow  # training in other processes

TINY = ["--arch", "transformer_tiny", "--max-tokens", "1000", "--lr", "3e-3", "--warmup-updates", "10",
        "--log-interval", "5", "--device", "cpu", "--precision", "fp32"]  # as tiny_config: resumed by it


def start_nmt(*args: str) -> subprocess.Popen:
    # The same number of threads as this process, so floating-point sums split the same way.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.Popen([sys.executable, "-m", "nmt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"nmt train ended before writing {path.name}: {process.communicate()[1]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {path.name} after {timeout} s")
        time.sleep(0.01)


def test_kill_9_mid_epoch_then_resume_reaches_the_same_weights(tiny_data_dir, tmp_path):
    save_dir = tmp_path / "killed"
    process = start_nmt("train", str(tiny_data_dir), *TINY, "--save-dir", str(save_dir),
                        "--save-interval-updates", "1", "--max-update", "1000", "-q")
    wait_for(save_dir / "checkpoint_1_3.pt", process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = load_checkpoint(save_dir / "checkpoint_last.pt")["train_state"]
    assert 2 <= killed_at["update"] < 9 and killed_at["epoch"] == 1  # mid-epoch 1 (9 updates per epoch)

    resumed = train(tiny_config(tiny_data_dir, save_dir, save_interval_updates=1, max_update=12))
    straight = train(tiny_config(tiny_data_dir, tmp_path / "straight", save_interval_updates=1, max_update=12))
    assert resumed.updates == straight.updates == 12
    assert_same_weights(save_dir / "checkpoint_last.pt", tmp_path / "straight" / "checkpoint_last.pt")


def test_ctrl_c_saves_the_last_checkpoint(tiny_data_dir, tmp_path):
    process = start_nmt("train", str(tiny_data_dir), *TINY, "--save-dir", str(tmp_path),
                        "--save-interval-updates", "2", "--max-update", "1000")
    wait_for(tmp_path / "checkpoint_1_2.pt", process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    state = load_checkpoint(tmp_path / "checkpoint_last.pt")["train_state"]
    assert state["update"] == interrupted_at(stderr)  # not an earlier interval save
    assert state["position"] == state["update"] % 9  # saved after a whole update


def test_bad_input_is_a_one_line_error(tiny_data_dir, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "train.en.tokens.npy").write_bytes(b"")
    assert_one_line_error(run_nmt("train", str(unfinished), "--save-dir", str(tmp_path / "a")),
                          "is not a finished `nmt preprocess` output")
    assert_one_line_error(run_nmt("train", str(tiny_data_dir), "--arch", "transformer_huge"), "unknown arch")
    assert_one_line_error(run_nmt("train", str(tiny_data_dir), "--arch", "transformer_tiny", "--max-tokens", "8",
                                  "--save-dir", str(tmp_path / "b")), "more than --max-tokens 8")


def test_resume_with_another_arch_is_a_one_line_error(tiny_data_dir, tmp_path):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=1))
    assert_one_line_error(run_nmt("train", str(tiny_data_dir), "--arch", "transformer_small", "--set", "dropout=0.2",
                                  "--save-dir", str(tmp_path)),
                          "different models (transformer_tiny (transformer) vs transformer_small")


def test_sigterm_saves_what_the_update_saves_and_exits_143(tiny_data_dir, tmp_path):
    # Every update is a save-interval update: the interrupted one must leave its own checkpoint too.
    process = start_nmt("train", str(tiny_data_dir), *TINY, "--save-dir", str(tmp_path),
                        "--save-interval-updates", "1", "--max-update", "1000")
    wait_for(tmp_path / "checkpoint_1_2.pt", process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert "SIGTERM: stopping after this update" in stderr and "Ctrl-C" not in stderr and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted at update "), stderr  # not a bare "interrupted"
    state = load_checkpoint(tmp_path / "checkpoint_last.pt")["train_state"]
    assert state["update"] == interrupted_at(stderr)
    assert (tmp_path / f"checkpoint_{state['epoch']}_{state['update']}.pt").exists()


def test_a_second_signal_stops_at_once_and_says_nothing_was_saved(tiny_data_dir, tmp_path):
    process = start_nmt("train", str(tiny_data_dir), *TINY, "--save-dir", str(tmp_path),
                        "--save-interval-updates", "1", "--max-update", "1000")
    wait_for(tmp_path / "checkpoint_1_1.pt", process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == ("interrupted at once: nothing was saved since the last "
                                               "checkpoint"), stderr
