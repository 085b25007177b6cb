"""``SAVE_DIR/metrics.jsonl``: the machine-readable record of a run, one JSON line per event.

Training appends a line per log interval (``"kind": "train"``) and per validation
(``"kind": "valid"``), each with its update number. Each line goes out in one ``write`` on a
descriptor opened with ``O_APPEND``, so a kill leaves at most one torn last line, which readers
skip. A resumed run restarts from its checkpoint's update and replays the updates after it, so
on start it first drops the lines of those updates (and any torn line): the file then tells one
history, with no update twice.

A record that cannot be written (a full disk) is lost with a warning, and training goes on: the
record is a report, and stopping would lose the updates since the last checkpoint. The next line
written starts on a line of its own, after whatever part of a record the failed write left.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Iterable

from nmt.files import atomic_write
from nmt.log import logger

FILE_NAME = "metrics.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every whole record of a metrics file, in order (a torn or foreign line is skipped)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return parse_records(handle)


def parse_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "update" in record:
            records.append(record)
    return records


class MetricsFile:
    def __init__(self, path: str | os.PathLike, resume_update: int):
        self.path = Path(path)
        if self.path.exists():
            text = self.path.read_text(encoding="utf-8", errors="replace")
            kept = [r for r in parse_records(text.splitlines()) if r["update"] <= resume_update]
            rewritten = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
            if rewritten != text:  # only when updates will be replayed (or a line was torn)
                with atomic_write(self.path) as handle:
                    handle.write(rewritten)
        self.lost = 0  # records not written since the last one that was

    def append(self, record: dict[str, Any]) -> None:
        line = (("\n" if self.lost else "") + json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if os.write(descriptor, line) < len(line):  # the disk filled up within the line
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            finally:
                os.close(descriptor)
        except OSError as exc:
            if not self.lost:
                logger.warning("cannot append to %s (%s): training goes on; its records are lost until it can "
                               "write again", self.path, exc.strerror or exc)
            self.lost += 1
            return
        if self.lost:
            logger.info("appending to %s again; %d record(s) were lost", self.path, self.lost)
            self.lost = 0
