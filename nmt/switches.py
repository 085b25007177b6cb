"""Environment variables that turn one of nmt's automatic choices off: ``NMT_CPU_KERNELS=0`` (nmt's
C kernels for decoding on CPU), ``NMT_HUGE_PAGES=0`` (huge pages for malloc). Read before torch is
imported, so this module imports nothing of nmt's."""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF = frozenset({"0", "false", "no", "off"})


def turned_off(variable: str, environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(variable, "").strip().lower() in OFF
