"""File helpers shared by every command: atomic writes and checked text reading."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterator

from nmt.errors import NmtError


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Write to a temp file in the target's directory, fsync, then rename over the target.

    A crash at any point leaves either the old file or the complete new one, never half of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; give what a plain open() would
    binary = "b" in mode
    try:
        with os.fdopen(fd, mode, **({} if binary else {"encoding": encoding})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def current_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename durable (POSIX needs the directory entry flushed too)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_binary(path: str | os.PathLike) -> IO[bytes]:
    """Open a plain or gzip-compressed file for reading bytes, with user-facing errors."""
    path = Path(path)
    if not path.exists():
        raise NmtError(f"file not found: {path}")
    if path.is_dir():
        raise NmtError(f"expected a file, got a directory: {path}")
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as exc:
        raise NmtError(f"cannot read {path}: {exc.strerror or exc}") from exc


def open_text(path: str | os.PathLike) -> IO[str]:
    """Open a plain or gzip-compressed UTF-8 text file for reading, with user-facing errors."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="strict", newline=None)


def text_lines(handle: IO[bytes], name: str | os.PathLike) -> Iterator[str]:
    """The lines of an open binary file without their line ends; bad UTF-8 is reported with its line.

    Lines are split on "\\n" only (as ``wc -l`` counts them) and decoded one by one, so the
    line number in an error is exact (a text wrapper decodes whole chunks ahead of the line).
    """
    line_no = 0
    try:
        for line_no, raw in enumerate(handle, start=1):
            yield raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as exc:
        raise NmtError(f"{name}: line {line_no} is not valid UTF-8 ({exc.reason})") from exc
    except (OSError, EOFError) as exc:
        raise NmtError(f"cannot read {name}: {exc}") from exc


def read_lines(path: str | os.PathLike) -> list[str]:
    """All lines of a text file (see ``text_lines``); "-" reads stdin (left open)."""
    stdin = str(path) == "-"
    with contextlib.nullcontext(sys.stdin.buffer) if stdin else open_binary(path) as handle:
        return list(text_lines(handle, "stdin" if stdin else path))


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict:
    """A YAML file that must hold a mapping (empty file: {}); ``what`` names it in errors ("recipe")."""
    import yaml  # only the commands that read recipes pay for it

    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NmtError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NmtError(f"cannot read {what} {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise NmtError(f"{path} is not valid YAML{line}: {getattr(exc, 'problem', None) or exc}") from exc
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise NmtError(f"{path} must be a YAML mapping of section: options")
    return document
