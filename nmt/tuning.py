"""Process-wide settings that make decoding smaller: one malloc arena and small oneDNN caches.

They change the whole process for the rest of its life, so nmt sets them only as the `nmt`
command, for the subcommands that decode (nmt/__main__.py: `nmt generate` and `nmt serve`; with
huge pages for malloc too where asked for, nmt/huge_pages.py), and the small
oneDNN caches for those that train (`nmt train`, `nmt run`). A program that
uses the Python API keeps its allocator and environment as they are, unless it asks::

    import nmt
    nmt.tune_for_decoding()  # before loading a model: as `nmt generate` decodes

Huge pages for malloc cannot be switched on in a running process: such a program can start with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in its environment (glibc 2.35 and later). Torch-free,
so that `nmt` sets all this before torch starts its threads.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

M_ARENA_MAX = -8  # glibc's mallopt parameter behind MALLOC_ARENA_MAX
ONEDNN_CACHE_CAPACITY = 16  # entries, in each of the two caches below; both default to 1,024


def tune_for_decoding() -> None:
    """One malloc arena and small oneDNN caches for this process, as `nmt generate` and `nmt serve`
    have them (see share_one_malloc_arena and bound_onednn_caches); call it before loading a model."""
    share_one_malloc_arena()
    bound_onednn_caches()


def share_one_malloc_arena() -> None:
    """Have threads started from now on allocate from glibc's main arena, not from one arena each.

    Each arena keeps the blocks freed in it for later: with two int8 workers the peak RSS of
    decoding was 628 MiB against 495 with one arena, at 1.02x the CPU time (docs/performance.md).
    Set before torch starts its threads, which would otherwise have arenas that the workers reuse.
    The setting is the process's, and stays (as ``MALLOC_ARENA_MAX=1`` would); a user's own
    MALLOC_ARENA_MAX is left as it is, and there is nothing to do without glibc's ``mallopt``.
    """
    mallopt = libc_function("mallopt")
    if "MALLOC_ARENA_MAX" not in os.environ and mallopt is not None:
        mallopt(M_ARENA_MAX, 1)


def bound_onednn_caches() -> None:
    """Keep the caches behind torch's bf16 products on CPU small, unless the user sized them.

    Those products run on oneDNN, which keeps a compiled primitive per matrix shape
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), and torch keeps the arguments it prepared for each
    shape (``LRU_CACHE_CAPACITY``). Decoding meets new shapes at nearly every step (a batch's rows
    change as sentences finish), so large caches only grow: about 280 MiB of peak RSS over the
    1,000 test sentences of transformer_small, for 3-6% more CPU time (docs/performance.md); 16
    holds every shape in use at once. Training meets new shapes at every batch: bf16 training's peak
    RSS was 2.95 GiB and growing after 100 updates on a Zen 4, 1.28 GiB with these (fp32: 1.20),
    at the same speed (benchmarks/notes/bf16-training-zen4-2026-11-28.md). Both are read when first
    used, so this acts in a process that has not run bf16 products yet.
    """
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(ONEDNN_CACHE_CAPACITY))


def libc_function(name: str) -> Callable[..., int] | None:
    """A function of the C library (glibc's mallopt, malloc_trim, prctl); None where it has none.

    Looked up in the parent, never in a forked worker: the lookup takes the dynamic loader's lock,
    which another thread of the parent may have held at the fork (the worker then waits forever)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError, TypeError):  # not in this C library (or no C library to ask)
        return None
