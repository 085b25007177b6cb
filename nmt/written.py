"""What `nmt run` wrote: a record beside the files a recipe writes whole (translations, attention,
an averaged model), so that running the recipe again may replace them and nothing else of the
same name (nmt/confinement.py).

The record, ``.nmt-written.json`` in the file's directory, holds each file's inode, size and
modification time as they were once written: a file replaced or edited since, by anyone, no
longer matches.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from nmt.files import atomic_write

RECORD = ".nmt-written.json"


def identity(path: str | os.PathLike) -> list[int] | None:
    """What the record keeps of a file (not following a symlink), or None when it is not there."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return [info.st_ino, info.st_size, info.st_mtime_ns]


def recorded(directory: Path) -> dict[str, list[int]]:
    try:
        entries = json.loads((directory / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def record_written(path: str | os.PathLike) -> None:
    """Remember ``path`` as nmt's own, as it is now (after it was written); only a regular file (not a
    device, nor stdout) is remembered."""
    path = Path(path)
    found = identity(path)
    if found is None or not stat.S_ISREG(os.lstat(path).st_mode):
        return
    entries = {name: entry for name, entry in recorded(path.parent).items() if name != path.name}
    with atomic_write(path.parent / RECORD) as handle:
        json.dump({**entries, path.name: found}, handle)


def nmt_wrote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file `nmt run` wrote and nobody changed since."""
    path = Path(path)
    found = identity(path)
    return found is not None and recorded(path.parent).get(path.name) == found
