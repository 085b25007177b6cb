"""The server's light batches decoded in forked worker processes, one intra-op thread each.

On threads of the server's process, decoding shares one GIL with the event loop (HTTP, JSON,
tokenization) and leaves cores idle: with 32 clients it served 18% of the offline rate on two
threads, where `nmt generate` forks one process per thread (nmt/generation/workers.py). So the
server forks its workers the same way, once, after the model is loaded and before uvicorn starts
any thread (a lock held by another thread at the fork would never be released in the child). Each
worker shares the weights copy-on-write, gets a batch and its search options through a pipe, and
sends back the hypotheses or the exception; a shared byte, set by the parent while its clients are
all gone, stops its search at the next step.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from nmt.generation.options import SearchOptions
from nmt.generation.search import Hypothesis
from nmt.generation.workers import ready_to_fork, start_forked_worker
from nmt.serving.batcher import Controls, TranslateFn, WorkerGone
from nmt.tuning import libc_function

STOP_POLL_SECONDS = 0.02  # how often the parent asks whether the batch's clients have all gone


class ForkedTranslate:
    """A TranslateFn that runs ``translate`` in a process forked at construction; one batch at a time."""

    def __init__(self, translate: TranslateFn, prctl: Any) -> None:
        context = multiprocessing.get_context("fork")
        self.stop = context.Value("b", 0, lock=False)  # shared with the child: set, its search stops
        self.connection, child_end = context.Pipe()
        self.process = context.Process(target=serve_batches, name="nmt-decode", daemon=True,
                                       args=(translate, child_end, self.stop, os.getpid(), prctl))
        self.process.start()
        child_end.close()  # the child's end only in the child: its death reads as the end of the pipe here

    def __call__(self, sources: list[np.ndarray], search: SearchOptions, controls: Controls | None,
                 should_stop) -> list[list[Hypothesis]]:
        if not self.process.is_alive():
            raise WorkerGone(self.ended(), had_batch=False)
        self.stop.value = 0
        try:
            self.connection.send((sources, search, controls))
        except OSError:
            raise WorkerGone(self.ended(), had_batch=False) from None
        try:
            while not self.connection.poll(STOP_POLL_SECONDS):
                if should_stop():
                    self.stop.value = 1
            outcome = self.connection.recv()
        except (EOFError, OSError):
            raise WorkerGone(self.ended(), had_batch=True) from None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def ended(self) -> str:
        """One line on how the worker's process ended."""
        self.process.join(1)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"decoding worker process {self.process.pid} ended ({how}; by the system when memory ran out?)"

    def close(self) -> None:
        """End the worker now (SIGKILL: it ignores SIGTERM)."""
        self.process.kill()
        self.process.join()
        self.connection.close()


def fork_decoders(translate: TranslateFn, workers: int) -> list[ForkedTranslate]:
    """``workers`` processes forked now, each decoding with ``translate`` (which it inherits, with the model);
    none is left running if one cannot be forked."""
    prctl = libc_function("prctl")  # looked up here: never in a forked child (see libc_function)
    decoders: list[ForkedTranslate] = []
    with ready_to_fork():
        try:
            for _ in range(workers):
                decoders.append(ForkedTranslate(translate, prctl))
        except BaseException:
            for decoder in decoders:
                decoder.close()
            raise
    return decoders


def serve_batches(translate: TranslateFn, connection: Connection, stop, parent: int, prctl: Any) -> None:
    """A worker's life: translate each batch the parent sends, send back its hypotheses or its exception."""
    start_forked_worker(parent, prctl, ignores_stop_signals=True)
    while True:
        try:
            sources, search, controls = connection.recv()
        except EOFError:  # the parent closed its end
            return
        try:
            outcome = translate(sources, search, controls, lambda: stop.value != 0)
        except Exception as exc:  # noqa: BLE001  (the parent raises it for the batch: the worker goes on)
            outcome = exc if survives_pickling(exc) else RuntimeError(f"{type(exc).__name__}: {exc}")
        connection.send(outcome)


def survives_pickling(exc: BaseException) -> bool:
    """Whether the parent can rebuild ``exc`` (an exception whose constructor takes other arguments cannot)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:  # noqa: BLE001
        return False
