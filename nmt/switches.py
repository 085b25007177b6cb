"""Environment variables that turn one of nmt's choices off or on: ``NMT_CPU_KERNELS=0`` (nmt's C
kernels for decoding on CPU), ``NMT_HUGE_PAGES=1`` (huge pages for `nmt generate`'s malloc). Read
before torch is imported, so this module imports nothing of nmt's."""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF = frozenset({"0", "false", "no", "off"})
ON = frozenset({"1", "true", "yes", "on"})


def turned_off(variable: str, environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(variable, "").strip().lower() in OFF


def turned_on(variable: str, environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(variable, "").strip().lower() in ON
