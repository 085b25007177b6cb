"""Several training processes through torch.distributed: under torchrun, or spawned by ``--nproc``.

torchrun (one node or many) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for
every process; ``--nproc N`` sets the same variables itself for N local processes and a free
port, so the trainer has one code path. NCCL carries the gradients between GPUs, gloo between
CPU processes. Stopping is the processes' business too: Ctrl-C and SIGTERM become a request that
all processes honour at the same update (StopRequest), after saving; a ``--nproc`` parent passes
the signal on and waits for its workers.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nmt.device import use_threads
from nmt.errors import NmtError, Stopped
from nmt.log import logger, setup_logging, state
from nmt.training.config import TrainConfig


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
ABORTED = "interrupted at once: nothing was saved since the last checkpoint"


class StopRequest:
    """Ctrl-C / SIGTERM ask training to stop after the current update (and save); in a single
    process a second signal stops at once, without saving."""

    def __init__(self, second_aborts: bool):
        self.signum: int | None = None  # the first signal received
        self.second_aborts = second_aborts
        self.previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            if self.second_aborts:
                raise Stopped(self.signum, ABORTED)
            return  # the processes stop together at the end of the update
        self.signum = signum
        again = f" ({SIGNAL_NAMES[signum]} again to stop at once, without saving)" if self.second_aborts else ""
        logger.warning("%s: stopping after this update and saving checkpoint_last.pt%s", SIGNAL_NAMES[signum], again)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


# The smallest batch a CPU training process is given by default, the one measured: at the CPU recipe's
# 4,096 tokens on two cores, two processes of 2,048 made 1.08-1.12x the updates per second of one
# process on two threads with the recipe's dropouts, 1.17-1.20x with dropout 0.1 (AMD EPYC Zen 4,
# bf16; docs/performance.md). Smaller batches were not measured; their matmuls run further from what
# a thread can do.
MIN_PROCESS_TOKENS = 2048


def processes_for_this_machine(config: TrainConfig, device: torch.device, max_positions: int) -> TrainConfig:
    """The processes that train on this machine, and their batches.

    --nproc on a machine without the GPUs for it: with ``device: auto`` and no GPU, one process
    accumulates the N processes' batches (``update_freq`` x N: updates of the same size); an explicit
    ``--device cpu`` keeps N processes, with a warning when they outnumber the cores.

    Otherwise, on a CPU, ``--cpu-processes`` (by default as many as leave each a batch of at least
    MIN_PROCESS_TOKENS and of the longest pair the model takes, up to one per thread, a divisor of
    the threads): P processes share the threads and each batches ``--max-tokens`` / P tokens, so that
    an update is the same size (2 processes take the steps of 1 with half the batch and twice the
    --update-freq; tested).
    """
    if device.type != "cpu" or launched_by_torchrun():
        return config
    if config.nproc > 1:
        if config.compute.device == "auto":
            logger.warning("--nproc %d with --device auto and no GPU: training in 1 process with --update-freq %d "
                           "(updates of the same size); give --device cpu to run %d CPU processes", config.nproc,
                           config.update_freq * config.nproc, config.nproc)
            return dataclasses.replace(config, nproc=1, update_freq=config.update_freq * config.nproc)
        warn_if_more_than_cores(config.nproc, "--nproc")
        return config
    threads = config.compute.threads or torch.get_num_threads()
    if config.cpu_processes:
        processes = config.cpu_processes
        warn_if_more_than_cores(processes, "--cpu-processes")
        if config.max_tokens is not None and config.max_tokens < processes:
            raise NmtError(f"--cpu-processes {processes} would leave each process batches of no token: give at least "
                           f"--max-tokens {processes}, or fewer processes")
    else:  # the most that keep a batch at MIN_PROCESS_TOKENS and share the threads evenly
        most = min(threads, config.max_tokens // max(MIN_PROCESS_TOKENS, max_positions)) if config.max_tokens else 1
        processes = next(count for count in range(max(1, most), 0, -1) if threads % count == 0)
    if processes <= 1:
        return config
    batch = {"max_tokens": config.max_tokens // processes if config.max_tokens else None,
             "max_sentences": max(1, config.max_sentences // processes) if config.max_sentences else None}
    shown = " and ".join(f"{value:,} {name.removeprefix('max_')}" for name, value in batch.items() if value)
    logger.info("training in %d CPU processes (gloo) of %d thread(s), each batch up to %s: updates of the same "
                "size as one process's (--cpu-processes%s)", processes, max(1, threads // processes), shown,
                "" if config.cpu_processes else f" unset; 1: one process on {threads} threads")
    # What config.yaml records: the processes and each one's batch; --threads, the threads they share.
    return dataclasses.replace(config, nproc=processes, cpu_processes=None, **batch,
                               compute=dataclasses.replace(config.compute, threads=threads))


def warn_if_more_than_cores(processes: int, option: str) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if processes > cores:
        logger.warning("%s %d CPU processes on %d core(s): they will compete for the cores and train slower than "
                       "%d process(es) with a larger --update-freq", option, processes, cores, cores)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_type: str) -> DistributedContext:
    """Join the process group described by the environment (a single process when there is none)."""
    if not launched_by_torchrun():
        return DistributedContext()
    context = DistributedContext(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                                 int(os.environ.get("LOCAL_RANK", 0)))
    if context.is_distributed and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(context.local_rank)
        backend = "nccl" if device_type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, rank=context.rank, world_size=context.world_size)
        except (RuntimeError, ValueError) as exc:
            raise NmtError(f"cannot join the {backend} process group: {str(exc).splitlines()[0]}") from exc
    if not context.is_main:
        logger.setLevel(logging.ERROR)  # only rank 0 reports progress
    return context


def shutdown_distributed(together: bool) -> None:
    """Leave the process group; after a finished run, all together (rank 0 is still saving when
    the others get here, and a gloo group torn down under a busy peer can abort the process)."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, context: DistributedContext) -> torch.Tensor:
    if context.is_distributed:
        dist.all_reduce(tensor)
    return tensor


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, target: Callable[[Any], Any], arguments: list, group: bool, port: int,
            log_settings: tuple[int, int, str], results: str) -> None:
    """One spawned process: the torchrun environment (when the processes form a group), the parent's
    logging, then ``target(arguments[rank])``."""
    world_size = len(arguments)
    if group:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    else:  # a terminal's Ctrl-C reaches the parent alone, which passes it on once (a second would abort)
        os.setpgrp()
    if "OMP_NUM_THREADS" not in os.environ:  # the cores shared, as --threads is (train_process)
        use_threads(os.cpu_count() or 1, world_size)
    verbose, level, log_format = log_settings
    setup_logging(verbose, level > logging.INFO, log_format)
    try:
        outcome = ("ok", target(arguments[rank]))
    except NmtError as exc:
        outcome = ("error", str(exc))
    except Stopped as exc:  # stopped by a signal, after saving (what was saved: the message)
        outcome = ("interrupted", (exc.signum, str(exc)))
    except KeyboardInterrupt:
        outcome = ("interrupted", (signal.SIGINT, ""))
    with open(result_path(results, rank), "wb") as handle:
        pickle.dump(outcome, handle)
    if outcome[0] == "error":
        raise SystemExit(1)


def result_path(results: str, rank: int) -> Path:
    return Path(results) / f"rank{rank}.pkl"


def read_outcome(results: str, rank: int) -> tuple[str, Any] | None:
    """A finished worker's (kind, value); None when it died before writing one."""
    try:
        with open(result_path(results, rank), "rb") as handle:
            return pickle.load(handle)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def gave_up(rank: int, process: mp.Process, results: str) -> bool:
    """A worker that exited with an error, or died without a result (killed, out of memory).

    A worker that wrote its result and then crashed on the way out (gloo's threads can abort the
    interpreter's exit) finished its work: the others are left to finish theirs.
    """
    if process.is_alive() or process.exitcode == 0:
        return False
    outcome = read_outcome(results, rank)
    return outcome is None or outcome[0] == "error"


def whose(rank: int, group: bool) -> str:
    """How a worker's error begins: rank 0's is the run's own; a model's is named by its number."""
    if not group:
        return f"model {rank + 1}: "
    return "" if rank == 0 else f"worker {rank}: "


def spawn(target: Callable[[Any], Any], arguments: list, group: bool = True) -> list:
    """Run ``target(arguments[rank])`` in one local process per argument; their results, by rank.

    ``group``: the processes form one process group (--nproc), where rank 0's result is the run's,
    a worker that wrote its result may die on the way out, and one that fails ends the others (they
    would wait for it forever); else each does work of its own (--models): every one must finish, and
    one that fails stops the others as SIGTERM does. An NmtError in a worker becomes an NmtError here.
    Ctrl-C or SIGTERM is passed on to the workers, which finish their update, save checkpoint_last.pt
    and stop; this process waits for them. A second signal ends them at once.
    """
    nproc = len(arguments)
    log_settings = (state["verbose"], logger.level, state["format"])
    with tempfile.TemporaryDirectory(prefix="nmt-spawn-") as results:
        context = mp.start_processes(_worker, args=(target, arguments, group, free_port(), log_settings, results),
                                     nprocs=nproc, join=False, start_method="spawn")
        processes = context.processes
        stop = StopRequest(second_aborts=True)
        forwarded, failed = False, None  # failed: the first worker that gave up
        try:
            with stop:
                while any(process.is_alive() for process in processes):
                    if failed is None:
                        failed = next((rank for rank, process in enumerate(processes)
                                       if gave_up(rank, process, results)), None)
                    if failed is not None and group:
                        break  # the others would wait for it forever; its reason is in its result file
                    if (stop.requested or failed is not None) and not forwarded:
                        forwarded = True
                        why = "" if failed is None else f"{whose(failed, group).rstrip(': ')} failed: "
                        logger.warning("%swaiting for the %d workers to finish their update and save", why, nproc)
                        for process in processes:
                            if process.is_alive():
                                os.kill(process.pid, stop.signum or signal.SIGTERM)
                    # only the live ones: an exited worker's sentinel stays ready and would make this spin
                    multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], timeout=0.2)
        finally:  # after a give-up or a second signal, the workers left are ended at once
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join()
        outcomes = {rank: outcome for rank in range(nproc) if (outcome := read_outcome(results, rank))}
    errors = [(rank, message) for rank, (kind, message) in sorted(outcomes.items()) if kind == "error"]
    if errors:
        rank, message = errors[0]
        raise NmtError(f"{whose(rank, group)}{message}")
    needed = [0] if group else sorted(range(nproc), key=lambda rank: rank != failed)  # the one that failed first
    missing = [rank for rank in needed if rank not in outcomes]
    if missing and not stop.requested:
        raise NmtError(f"{whose(missing[0], group)}a training worker was killed before it finished (out of memory?); "
                       "re-run the command to resume from checkpoint_last.pt")
    interrupted = [outcomes[rank][1] for rank in sorted(outcomes) if outcomes[rank][0] == "interrupted"]
    if stop.requested or interrupted:
        signum, message = interrupted[0] if interrupted else (signal.SIGINT, "")
        raise Stopped(stop.signum or signum, message)
    return [outcomes[rank][1] for rank in sorted(outcomes)]
