"""Decoding several batches at once, each on a thread of its own (``--workers``).

One beam-search step is a handful of matrix products and many small operations; with two
intra-op threads on one batch the small ones barely speed up, while two batches on one thread
each keep both cores busy (CTranslate2's ``inter_threads``, Marian's CPU workers). The model is
shared: torch releases the GIL inside its kernels and inference reads the weights only. The
intra-op threads are split among the workers, and grad mode and autocast, which are per thread,
are entered by the function each worker runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Iterable, Iterator

import torch

from nmt.parallel import Item, Result, ordered_map

M_ARENA_MAX = -8  # glibc's mallopt parameter behind MALLOC_ARENA_MAX


def threads_per_worker(workers: int) -> int:
    """This process's intra-op threads shared among ``workers`` (at least one each)."""
    return max(1, torch.get_num_threads() // workers)


def share_one_malloc_arena() -> None:
    """Have threads started from now on allocate from glibc's main arena, not from one arena each.

    Each arena keeps the blocks freed in it for later: with two int8 workers the peak RSS of
    decoding was 628 MiB against 495 with one arena, at 1.02x the CPU time (docs/performance.md).
    Called before a model is loaded, since torch's own threads, started then, would otherwise
    have arenas that the workers reuse. The setting is the process's, and stays (as
    ``MALLOC_ARENA_MAX=1`` would); a user's own MALLOC_ARENA_MAX is left as it is, and there is
    nothing to do without glibc's ``mallopt``.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):  # no mallopt in this C library (or no C library to ask)
        return
    mallopt(M_ARENA_MAX, 1)


def map_in_workers(function: Callable[[Item], Result], items: Iterable[Item], workers: int) -> Iterator[Result]:
    """``map(function, items)`` with ``workers`` threads, results in the order of ``items``.

    Each worker sets its own thread count; torch also keeps that count for threads started later,
    so the caller's count is set again at the end (else each call would halve it for the next)."""
    if workers == 1:
        yield from map(function, items)
        return
    original = torch.get_num_threads()
    try:
        yield from ordered_map(function, items, workers, name="nmt-decode",
                               initializer=functools.partial(torch.set_num_threads, threads_per_worker(workers)))
    finally:
        torch.set_num_threads(original)
