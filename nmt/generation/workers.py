"""Decoding several batches at once (``--workers``): on forked processes or on threads.

One beam-search step is a handful of matrix products and many small operations; with two
intra-op threads on one batch the small ones barely speed up, while two batches on one thread
each keep both cores busy (CTranslate2's ``inter_threads``, Marian's CPU workers). Threads of one
process share the GIL, which torch drops and takes back around every operation: two int8 workers
on two cores spent 1.35x the CPU time of one for 1.2x its speed. So `nmt generate`, on Linux and
where a worker gets one thread, forks each worker from the process that loaded the model: it
shares the weights (copy-on-write pages that inference never writes) and nothing else, and two
decoded 1.25x as fast as two threads (docs/performance.md). Workers are threads where a worker
has several intra-op threads (GNU OpenMP cannot start its threads again in a forked child), in
the library unless asked (the server forks workers of its own: nmt/serving/processes.py), and in
the Python API while its program runs other threads (one may hold a lock at the fork that the
child would wait on forever). Threads share the model (inference reads the weights only); grad
mode and autocast, which are per thread, are entered by the function each worker runs. The
intra-op threads are split among the workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

import torch

from nmt.errors import NmtError
from nmt.parallel import Item, Result, ordered_map
from nmt.tuning import libc_function


def threads_per_worker(workers: int) -> int:
    """This process's intra-op threads shared among ``workers`` (at least one each)."""
    return max(1, torch.get_num_threads() // workers)


def release_freed_memory() -> None:
    """Give the pages of freed blocks back to the system (glibc's ``malloc_trim``), before forking
    workers: loading and quantizing a model leave some (46 MiB for int8 transformer_small), which a
    forked worker would otherwise copy as it reuses them while the parent keeps its own copy. Nothing
    to do without glibc."""
    malloc_trim = libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


@contextlib.contextmanager
def ready_to_fork() -> Iterator[None]:
    """Around forking decoding workers: freed pages given back first (release_freed_memory), and the
    objects the workers inherit frozen (gc.freeze), so that their collectors leave those objects, and
    their pages, alone."""
    release_freed_memory()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def forks_workers(workers: int) -> bool:
    """Whether ``workers`` workers of nmt's decoder may be forked processes: on Linux, with one
    intra-op thread each. (Not CTranslate2's: its own threads, which do its work, are not in a
    forked child.)"""
    return workers > 1 and sys.platform == "linux" and threads_per_worker(workers) == 1


def map_in_workers(function: Callable[[Item], Result], items: Iterable[Item], workers: int,
                   processes: bool = False) -> Iterator[Result]:
    """``map(function, items)`` with ``workers`` threads, or forked ``processes`` (see
    ``forks_workers``), results in the order of ``items``.

    Each worker sets its own thread count; torch also keeps that count for threads started later,
    so the caller's count is set again at the end (else each call would halve it for the next)."""
    if workers == 1:
        yield from map(function, items)
        return
    if processes:
        yield from map_in_processes(function, items, workers)
        return
    original = torch.get_num_threads()
    try:
        yield from ordered_map(function, items, workers, name="nmt-decode",
                               initializer=functools.partial(torch.set_num_threads, threads_per_worker(workers)))
    finally:
        torch.set_num_threads(original)


_forked_function: Callable[[Any], Any] | None = None  # what forked workers run: inherited at the fork, never pickled
_fork_lock = threading.Lock()  # one function at a time between setting it and forking


def run_forked(item: Item) -> Result:
    assert _forked_function is not None, "a decoding worker that was not forked by ForkedWorkers"
    return _forked_function(item)


PR_SET_PDEATHSIG = 1  # Linux prctl option: the signal a process gets when its parent ends


def end_with_parent(parent: int, prctl: Callable[..., int] | None, signum: int = signal.SIGTERM) -> None:
    """Have the kernel send this forked worker ``signum`` when its parent ends, however it ends (a
    plain `kill` of the parent reaches it alone), and end now if the parent is gone already.
    ``prctl`` is the C library's, looked up by the parent (see ``libc_function``)."""
    if prctl is None or prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum)) != 0:
        return
    if os.getppid() != parent:
        os._exit(128 + signum)


def start_forked_worker(parent: int, prctl: Callable[..., int] | None, ignores_stop_signals: bool = False) -> None:
    """A forked worker: one thread; it ends with its parent; Ctrl-C (sent to the whole process group)
    ends it at once and in silence, the caller reports it; its output bypasses what the parent's
    progress display made of stdout and stderr (a lock held at the fork would never be released here).

    ``ignores_stop_signals`` (the server's workers): Ctrl-C reaches the whole process group, and systemd
    stops a service with SIGTERM to each of its processes, while the server answers the requests in
    progress (its workers decoding them) before it ends them. Such a worker ignores both, and is
    killed (SIGKILL) when its parent ends, however it ends."""
    end_with_parent(parent, prctl, signal.SIGKILL if ignores_stop_signals else signal.SIGTERM)
    torch.set_num_threads(1)
    if ignores_stop_signals:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job's parent ignores it too
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


class ForkedWorkers:
    """``workers`` processes forked from this one at the first item given to ``map``, one intra-op
    thread each, that run ``function`` on the items (pickled) and send back the results (pickled).
    They inherit ``function`` and all it holds (the model, the sources): it is never pickled.

    They live until ``close`` (or until this object is collected), so that a caller translating
    again and again keeps them (KeptWorkers): a fresh worker's first pass over a test set took 2-30%
    longer than its next ones while it faulted in the memory its searches use (benchmarks/notes/
    amd-epyc-zen4-2026-11-28.md). They compute with what ``function`` held at the fork. An error in
    ``function`` reaches the caller; a worker that dies (killed when memory ran out) is a one-line
    error."""

    def __init__(self, function: Callable[[Any], Any], workers: int):
        self.function, self.workers = function, workers
        self.pool: ProcessPoolExecutor | None = None
        self.idle = True  # no item of the last ``map`` is left queued or running

    def map(self, items: Iterable[Item]) -> Iterator[Result]:
        """Results in the order of ``items``; leaving early cancels the items not started."""
        futures, completed = [], False
        self.idle = False
        try:
            for item in items:
                futures.append(self.submit(item))
            completed = not futures
            for position, future in enumerate(futures, start=1):
                result = future.result()
                completed = position == len(futures)  # a consumer may stop asking after the last one (zip)
                yield result
        except BrokenProcessPool as error:
            self.close(wait=False)
            raise NmtError("a decoding worker process ended unexpectedly (killed by a signal, or by the "
                           "system when memory ran out); --workers 1 decodes in this process") from error
        finally:
            self.idle = completed
            if not completed:
                for future in futures:
                    future.cancel()

    def submit(self, item: Item):
        global _forked_function
        if self.pool is not None:
            return self.pool.submit(run_forked, item)
        pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=start_forked_worker, initargs=(os.getpid(), libc_function("prctl")))
        with _fork_lock, ready_to_fork():  # the first item forks all the workers
            _forked_function = self.function
            try:
                future = pool.submit(run_forked, item)
            except BaseException:  # a failed fork: no worker is left, none is forked later outside this lock
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            finally:
                _forked_function = None
        self.pool = pool
        return future

    def alive(self) -> bool:
        """Forked, and none of the workers has died since (Ctrl-C at a prompt reaches them too)."""
        return self.pool is not None and all(process.is_alive() for process in self.pool._processes.values())

    def close(self, wait: bool = True) -> None:
        """End the workers: at once (``wait`` False: the items not started are dropped), or when the
        items given are done."""
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=not wait)
            self.pool = None


class KeptWorkers:
    """One caller's ForkedWorkers (a Translator's, `nmt generate`'s), kept from call to call. A call
    that needs at most as many workers, for the same ``key`` (the objects their function holds,
    compared by identity), gets them without a fork; otherwise new ones are forked where the call
    may fork (no other thread of the program may hold a lock at the fork). One call at a time holds
    them (``use``): another thread's call meanwhile decodes on threads."""

    def __init__(self) -> None:
        self.forked: ForkedWorkers | None = None
        self.key: tuple = ()
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, key: tuple, function: Callable[[Any], Any], workers: int,
            may_fork: bool) -> Iterator[ForkedWorkers | None]:
        """The workers for one call, held to its end; None where another call holds them, or where none
        fit and this call may not fork."""
        if not self.lock.acquire(blocking=False):
            yield None
            return
        try:
            kept = self.forked
            if kept is None or kept.workers < workers or not kept.alive() or \
                    any(a is not b for a, b in zip(key, self.key)):
                kept = None
                if may_fork:
                    self.close_unlocked()
                    kept = ForkedWorkers(function, workers)
                    self.forked, self.key = kept, key
            yield kept
        finally:
            self.lock.release()

    def close(self) -> None:
        """End the workers, once the call holding them (if any) has ended."""
        with self.lock:
            self.close_unlocked()

    def close_unlocked(self) -> None:
        if self.forked is not None:
            self.forked.close(wait=self.forked.idle)  # a call left midway: its batches not started are dropped
            self.forked, self.key = None, ()


def map_in_processes(function: Callable[[Item], Result], items: Iterable[Item], workers: int) -> Iterator[Result]:
    """``map(function, items)`` on ``workers`` processes forked for this call (see ForkedWorkers)."""
    forked = ForkedWorkers(function, workers)
    try:
        yield from forked.map(items)
    finally:  # done: the workers end now; else the items not started are dropped and the rest ends as it may
        forked.close(wait=forked.idle)
