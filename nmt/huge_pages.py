"""2 MiB pages for the C allocator's memory: glibc's ``glibc.malloc.hugetlb=1`` tunable.

Decoding reads the same weights, caches and activations at every step. With 4 KiB pages their
addresses overflow the TLB, and each forked decoding worker faults its memory in a page at a
time. Where Linux gives transparent huge pages to memory that asks for them (``madvise`` mode, the
usual default), glibc 2.35 and later asks for them when ``GLIBC_TUNABLES`` holds
``glibc.malloc.hugetlb=1``. Whether that pays depends on the CPU: decoding ran 4-8% faster on an
AMD Zen 5, but a whole `nmt generate` of 1,000 sentences took 1.11x as long on an Intel Xeon with
AMX and 1.08x on an AMD Zen 4 (docs/translating.md). So it is opt-in: ``NMT_HUGE_PAGES=1``
makes `nmt` start itself again with the tunable, before importing torch or anything else it needs
(glibc reads its tunables once, as a process starts); a ``GLIBC_TUNABLES`` that already sets
``glibc.malloc.hugetlb`` is left alone. A program using nmt's Python API can set the tunable
before it starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from nmt.switches import turned_on

TUNABLE = "glibc.malloc.hugetlb"
RESTARTED = "NMT_RESTARTED_FOR_HUGE_PAGES"  # set in the new process: it never starts itself again
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def transparent_huge_pages() -> str | None:
    """The kernel's mode for transparent huge pages (always, madvise or never); None without them."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def environment_with_huge_pages(environ: Mapping[str, str], mode: str | None,
                                glibc: tuple[int, int] | None) -> dict[str, str] | None:
    """``environ`` with the tunable added to GLIBC_TUNABLES where it would give huge pages that the
    process does not get already; None where there is nothing to do."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not turned_on("NMT_HUGE_PAGES", environ) or RESTARTED in environ or TUNABLE in tunables:
        return None  # not asked for, the user's own tunable, or this process has started again already
    if mode != "madvise" or glibc is None or glibc < (2, 35):
        return None  # no huge pages to ask for, or none that the tunable would add
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1", RESTARTED: "1"}


def describe() -> str:
    """For log lines and benchmark tables: the pages malloc's memory gets here, as far as Linux says."""
    mode = transparent_huge_pages()
    if mode == "always":
        return "malloc in 2 MiB pages (transparent huge pages: always)"
    if mode == "madvise" and f"{TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", ""):
        return f"malloc in 2 MiB pages ({TUNABLE}=1)"
    return "malloc in 4 KiB pages" if mode is not None else "malloc's pages: not known here"


def restart_with_huge_pages() -> None:
    """Replace this process by the same command line with huge pages for malloc (see above);
    returns where there is nothing to do. For `nmt` (nmt/__main__.py) and the benchmarks that time
    it, as their first step."""
    if sys.platform != "linux" or not sys.executable or not getattr(sys, "orig_argv", None):
        return
    environ = environment_with_huge_pages(os.environ, transparent_huge_pages(), glibc_version())
    if environ is not None:
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
        except OSError:  # not started again: this process goes on with 4 KiB pages
            return
