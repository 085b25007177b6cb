"""Reading stdin as lines arrive, so ``nmt generate -i -`` can sit behind a pipe or a prompt.

Python's buffered readers hide whether more input is waiting (``select`` sees the descriptor,
not their buffer), so this reads the descriptor itself: it blocks for the first line of a
batch, then takes the lines already there and stops where the input would block.
"""

from __future__ import annotations

import os
import select
import stat
import sys
from collections import deque

from nmt.errors import NmtError


def is_stream(file) -> bool:
    """A pipe or terminal (translate as lines arrive), not a regular file or an in-memory stand-in."""
    try:
        return not stat.S_ISREG(os.fstat(file.fileno()).st_mode)
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


class LineReader:
    """Lines (without their line ends) of a file descriptor, read in batches as they arrive."""

    def __init__(self, fd: int | None = None, name: str = "stdin"):
        self.fd = sys.stdin.fileno() if fd is None else fd
        self.name = name
        self.ready: deque[bytes] = deque()  # complete lines not yet handed out
        self.partial = b""  # the start of a line whose end has not arrived
        self.eof = False
        self.line_no = 0

    def next_batch(self, size: int | None = None) -> list[str]:
        """Blocks for one line, then: ``size`` None, the lines already waiting; ``size`` N, until
        there are N lines (or the input ends). An empty list means the input has ended."""
        batch: list[str] = []
        while size is None or len(batch) < size:
            if self.ready:
                batch.append(self.decode(self.ready.popleft()))
            elif self.eof or (batch and size is None and not readable(self.fd)):
                break
            else:
                self.fill()
        return batch

    def fill(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError as exc:
            raise NmtError(f"cannot read {self.name}: {exc.strerror or exc}") from exc
        if not chunk:
            self.eof = True
            if self.partial:  # a last line without a line end
                self.ready.append(self.partial)
            return
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        self.ready.extend(lines)

    def decode(self, raw: bytes) -> str:
        self.line_no += 1
        try:
            return raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as exc:
            raise NmtError(f"{self.name}: line {self.line_no} is not valid UTF-8 ({exc.reason})") from exc
