"""Data-parallel training: 2 gloo processes on CPU, each batching half of --max-tokens, take the same steps as 1
process with --update-freq 2."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import interrupted_at, tiny_config

from nmt.checkpoint.format import load_checkpoint
from nmt.data.dataset import DataDir
from nmt.errors import NmtError
from nmt.log import logger, setup_logging
from nmt.training.distributed import spawn
from nmt.training.side_by_side import train_models
from nmt.training.trainer import train

pytestmark = pytest.mark.slow  # training in other processes


@pytest.fixture()
def json_log_lines(capfd):
    """A reader of the train lines logged so far as JSON (the spawned workers log like their parent)."""
    handlers, level = logger.handlers[:], logger.level

    def read() -> list[dict]:
        lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("kind") == "train"]

    yield read
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_two_processes_equal_one_with_update_freq_two(tiny_data_dir, tmp_path, json_log_lines):
    # Dropout stays on: each batch's dropout is seeded by its place in the epoch, not by the process.
    options = {"max_update": 3, "save_interval_updates": 2, "valid_subset": "none", "log_interval": 1}
    setup_logging(log_format="json")  # here, not in a fixture: the handler keeps the sys.stderr of its phase
    single = train(tiny_config(tiny_data_dir, tmp_path / "single", update_freq=2, **options))
    single_lines = json_log_lines()
    # Two CPU processes as `--cpu-processes 2` lays them out: each batches half of --max-tokens.
    parallel = train(tiny_config(tiny_data_dir, tmp_path / "parallel", cpu_processes=2, max_tokens=2000, **options))
    parallel_lines = json_log_lines()
    assert parallel.updates == single.updates == 3
    assert parallel.train_loss == pytest.approx(single.train_loss, rel=1e-5)  # losses summed over both ranks
    # Adam would hide a constant error in the gradient's scale; the logged gradient norms do not.
    assert [line["update"] for line in parallel_lines] == [line["update"] for line in single_lines] == [1, 2, 3]
    for one, two in zip(single_lines, parallel_lines):
        assert two["gnorm"] == pytest.approx(one["gnorm"], rel=1e-5)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    a = load_checkpoint(tmp_path / "single" / "checkpoint_last.pt")
    b = load_checkpoint(tmp_path / "parallel" / "checkpoint_last.pt")
    assert a["train_state"]["position"] == b["train_state"]["position"] == 6
    for name, tensor in a["model"].items():
        if name.endswith("k_proj.bias"):
            # A key bias shifts all of a query's scores equally, so softmax ignores it: its true gradient
            # is 0, and Adam (update ~ g/sqrt(g^2)) turns the rounding noise left in its place into steps.
            continue
        difference = (b["model"][name] - tensor).abs().max().item()
        assert difference < 2e-6, f"{name} differs by {difference}"
    assert sorted(p.name for p in (tmp_path / "parallel").iterdir()) == \
        ["checkpoint_1_2.pt", "checkpoint_last.pt", "config.yaml", "metrics.jsonl"]
    recorded = yaml.safe_load((tmp_path / "parallel" / "config.yaml").read_text())["train"]
    assert (recorded["nproc"], recorded["max_tokens"], recorded["cpu_processes"]) == (2, 1000, None)


def test_bad_input_fails_before_spawning(tiny_data_dir, tmp_path):
    with pytest.raises(NmtError, match="unknown arch"):
        train(tiny_config(tiny_data_dir, tmp_path, nproc=2, device="cpu", arch="transformer_nano"))
    with pytest.raises(NmtError, match="fewer than the 400 processes"):
        train(tiny_config(tiny_data_dir, tmp_path, nproc=400, device="cpu"))


def test_the_workers_train_on_the_inputs_the_parent_checked(tiny_data_dir, tmp_path, capfd):
    """--nproc opens and checks the inputs once, before spawning, and hands them to its workers: what
    the check reports (here the pairs left out) is reported once, and the workers train on that data."""
    train_set = DataDir.open(tiny_data_dir).split("train")
    longest = int(np.maximum(train_set.source.sizes, train_set.target.sizes).max())
    handlers, level = logger.handlers[:], logger.level
    setup_logging()
    try:
        summary = train(tiny_config(tiny_data_dir, tmp_path, nproc=2, device="cpu", max_update=2, valid_subset="none",
                                    skip_invalid_size_inputs=True, model={"max_positions": longest - 1}))
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    stderr = capfd.readouterr().err
    assert summary.updates == 2 and "Traceback" not in stderr
    assert stderr.count("sentence pairs longer than") == 1, stderr


def test_sigterm_to_the_parent_waits_for_the_workers_to_save(tiny_data_dir, tmp_path):
    """The parent forwards SIGTERM, returns only once its workers have saved, and exits 143."""
    command = [sys.executable, "-m", "nmt", "train", str(tiny_data_dir), "--arch", "transformer_tiny",
               "--max-tokens", "500", "--device", "cpu", "--nproc", "2", "--save-dir", str(tmp_path),
               "--save-interval-updates", "1", "--max-update", "1000", "--valid-subset", "none"]
    parent = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while not (tmp_path / "checkpoint_1_1.pt").exists():
        assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read() if parent.poll() else ""
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    _, stderr = parent.communicate(timeout=120)
    assert parent.returncode == 143 and "Traceback" not in stderr, stderr
    assert "waiting for the 2 workers" in stderr
    state = load_checkpoint(tmp_path / "checkpoint_last.pt")["train_state"]  # saved before the parent returned
    assert state["update"] == interrupted_at(stderr)  # the stop's save, not an earlier one
    assert (tmp_path / f"checkpoint_{state['epoch']}_{state['update']}.pt").exists()


def finish_then_crash_on_exit(delay: float) -> str:
    """Rank 1 finishes at once and aborts on the way out, as gloo's threads sometimes make a worker do;
    rank 0 is still working then."""
    if int(os.environ["RANK"]) == 1:
        atexit.register(os.abort)
        return "rank 1"
    time.sleep(delay)
    return "rank 0"


def die_without_result(delay: float) -> str:
    if int(os.environ["RANK"]) == 1:
        os._exit(137)  # what the kernel's out-of-memory killer leaves
    time.sleep(delay)
    return "rank 0"


def test_a_worker_crashing_after_its_result_leaves_the_others_to_finish():
    assert spawn(finish_then_crash_on_exit, [2.0, 2.0])[0] == "rank 0"


def test_a_worker_dying_without_a_result_ends_the_others_at_once():
    started = time.monotonic()
    with pytest.raises(NmtError, match="killed before it finished"):
        spawn(die_without_result, [60.0, 60.0])
    assert time.monotonic() - started < 30  # rank 0 was not left to sleep its 60 s


def test_models_train_side_by_side_each_as_its_seed_would_alone(tiny_data_dir, tmp_path):
    """--models 2: two processes, each the run --seed 1 / 2 would be in its own save dir, on its share of the
    threads."""
    options = {"max_update": 3, "valid_subset": "none", "threads": 3}  # shared 2 + 1
    summaries = train_models(tiny_config(tiny_data_dir, tmp_path / "pair", models=2, **options))
    members = [tmp_path / "pair" / "model1", tmp_path / "pair" / "model2"]
    assert [summary.save_dir for summary in summaries] == [str(member) for member in members]
    assert [summary.updates for summary in summaries] == [3, 3]
    recorded = [yaml.safe_load((member / "config.yaml").read_text())["train"] for member in members]
    assert [(entry["seed"], entry["models"], entry["threads"]) for entry in recorded] == [(1, 1, 2), (2, 1, 1)]
    alone = train(tiny_config(tiny_data_dir, tmp_path / "alone", seed=2, **{**options, "threads": 1}))
    assert alone.updates == 3
    first, second, by_itself = (load_checkpoint(directory / "checkpoint_last.pt")["model"]
                                for directory in (*members, tmp_path / "alone"))
    assert all(torch.equal(second[name], by_itself[name]) for name in second)
    assert not all(torch.equal(first[name], second[name]) for name in first)  # another seed, another model


def test_a_model_killed_is_named_and_the_others_stop():
    started = time.monotonic()
    with pytest.raises(NmtError, match="^model 2: a training worker was killed"):
        spawn(die_without_result_as, [(0, 60.0), (1, 60.0)], group=False)
    assert time.monotonic() - started < 30


def die_without_result_as(rank_and_delay: tuple[int, float]) -> str:
    rank, delay = rank_and_delay
    if rank == 1:
        os._exit(137)
    time.sleep(delay)
    return "model 1"


def test_models_are_their_own_processes(tiny_data_dir, tmp_path):
    with pytest.raises(NmtError, match="--models trains each model in one process of its own"):
        tiny_config(tiny_data_dir, tmp_path, models=2, nproc=2)
    with pytest.raises(NmtError, match="train_models"):
        train(tiny_config(tiny_data_dir, tmp_path, models=2))
    with pytest.raises(NmtError, match="leave out --nproc and --cpu-processes"):
        tiny_config(tiny_data_dir, tmp_path, models=2, cpu_processes=2)
    with pytest.raises(NmtError, match="--models 3 on --threads 2"):
        tiny_config(tiny_data_dir, tmp_path, models=3, threads=2)
    with pytest.raises(NmtError, match="is the data directory"):
        train_models(tiny_config(tiny_data_dir, tiny_data_dir, models=2, threads=2))
    assert not any(tmp_path.iterdir())


def test_models_stopped_by_ctrl_c_at_a_terminal_each_save(tiny_data_dir, tmp_path):
    """The terminal's SIGINT reaches the whole process group: the models take the parent's one signal
    (a second would stop them without saving)."""
    command = [sys.executable, "-m", "nmt", "train", str(tiny_data_dir), "--arch", "transformer_tiny",
               "--max-tokens", "500", "--device", "cpu", "--models", "2", "--threads", "2", "--save-dir", str(tmp_path),
               "--save-interval-updates", "1", "--max-time", "10m", "--valid-subset", "none"]
    parent = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not all((tmp_path / member / "checkpoint_1_2.pt").exists() for member in ("model1", "model2")):
        assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read() if parent.poll() else ""
        time.sleep(0.05)
    os.killpg(parent.pid, signal.SIGINT)
    _, stderr = parent.communicate(timeout=120)
    assert parent.returncode == 130 and "Traceback" not in stderr, stderr
    assert "interrupted at once" not in stderr  # a second signal would have stopped them without saving
    for member in ("model1", "model2"):
        state = load_checkpoint(tmp_path / member / "checkpoint_last.pt")["train_state"]
        assert (tmp_path / member / f"checkpoint_{state['epoch']}_{state['update']}.pt").exists()  # the stop's save


def fail_as_model_two(rank_and_marker: tuple[int, str]) -> str:
    """Model 2 fails once model 1 works; model 1 works until a signal, which it notes in ``marker``."""
    rank, marker = rank_and_marker
    ready = Path(marker).with_suffix(".ready")
    if rank == 1:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise NmtError("the gradient norm became nan")

    def note(signum, frame):
        Path(marker).write_text(signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, note)
    ready.touch()
    time.sleep(60)
    return "model 1"


def test_a_model_that_fails_lets_the_others_save_and_stop(tmp_path):
    marker = tmp_path / "signal"
    with pytest.raises(NmtError, match="^model 2: the gradient norm became nan"):
        spawn(fail_as_model_two, [(0, str(marker)), (1, str(marker))], group=False)
    assert marker.read_text() == "SIGTERM"  # asked to save and stop, not killed
