"""File helpers shared by every command: atomic writes, exclusive locks, checked text reading."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import uuid
import zlib
from collections.abc import Hashable
from pathlib import Path
from typing import IO, Iterable, Iterator

from nmt.errors import NmtError
from nmt.log import logger


def sha256_of(fd: int) -> str:
    """The SHA-256 of the whole file open on ``fd`` (read from its start, whatever the descriptor's offset)."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind an exception, if any: torch.save hides ENOSPC in a chained RuntimeError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def cannot_write(path: str | os.PathLike, error: OSError) -> NmtError:
    return NmtError(f"cannot write {path}: {error.strerror or error}")


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the end of the block, then reach their handlers in order.

    For writes that a signal must not cut in half: torch.save's zip writer, stopped in its Python
    callback, writes its end to the closed file when it is collected and aborts the process.
    Only the main thread has signal handlers; elsewhere the block runs as is, and so does a signal
    whose handler Python did not install (it could not be put back). A block that fails while a
    signal waits logs its error first: the signal's handler (Ctrl-C: "interrupted") ends the command.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = [signum for signum in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(signum) is not None]
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in held}
    try:
        yield
    except BaseException as exc:
        if received:
            logger.error("%s", exc)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in received:
            signal.raise_signal(signum)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Write to a temp file in the target's directory, fsync, then rename over the target.

    A crash at any point leaves either the old file or the complete new one, never half of one.
    Only regular files (or new paths) are replaced: a device, a FIFO or "-" (stdout) is written in
    place, and a symlink is followed, so ``-o /dev/null`` stays a device even for root, but only a
    symlink of the user's own (or root's): see ``resolve_output``. The replaced file is a new one
    (a hard link's other names keep the old text; the mode is kept). A failure to write (disk full,
    read-only, a file where a directory should be) is a one-line NmtError.
    """
    binary = "b" in mode
    if str(path) == "-":
        yield sys.stdout.buffer if binary else sys.stdout
        (sys.stdout.buffer if binary else sys.stdout).flush()
        return
    shown = Path(path)  # errors name the path the user gave
    path = resolve_output(path)  # a symlink's target is what gets written
    try:
        kind = path.stat().st_mode
    except OSError:
        kind = None  # a new file (or one we cannot see: the write below says why)
    if kind is not None and stat.S_ISDIR(kind):
        raise NmtError(f"cannot write {shown}: it is a directory")
    if kind is not None and not stat.S_ISREG(kind):
        with _reported(shown), open_in_place(path, mode, encoding) as handle:
            yield handle
        return
    tmp = None
    try:
        with _reported(shown):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            # mkstemp makes 0600; give what a plain open() would: the file's own mode when it exists
            os.fchmod(fd, stat.S_IMODE(kind) if kind is not None else 0o666 & ~current_umask())
            with os.fdopen(fd, mode, **({} if binary else {"encoding": encoding})) as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def open_in_place(path: Path, mode: str, encoding: str | None) -> IO:
    """A device or FIFO that ``path`` (symlinks resolved) named when it was looked at, opened for writing
    without following a symlink planted since, and refused if it has become a regular file (which
    atomic_write would replace, not write in place)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NmtError(f"cannot write {path}: it was replaced by a regular file while being opened")
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))


def resolve_output(path: str | os.PathLike) -> Path:
    """The real path of an output, refusing to follow a symlink that another user owns.

    In a shared directory (/tmp) anyone may plant ``out.txt -> ~/.bashrc``; written through, it would
    replace the user's file. As the kernel's protected_symlinks does for sticky directories, and
    everywhere here, a symlink on the way (the last name or a directory) is followed only when the
    user or root owns it.
    """
    pending = list(Path(os.path.join(os.getcwd(), path)).parts[1:])
    resolved, followed = Path("/"), 0
    while pending:
        name = pending.pop(0)
        if name in (".", ""):
            continue
        if name == "..":
            resolved = resolved.parent
            continue
        candidate = resolved / name
        try:
            info = os.lstat(candidate)
        except OSError:  # a new file (or one we cannot see: the write says why): nothing more to follow
            return candidate.joinpath(*pending)
        if not stat.S_ISLNK(info.st_mode):
            resolved = candidate
            continue
        if info.st_uid not in (os.geteuid(), 0):
            raise NmtError(f"refusing to write {path}: {candidate} is a symbolic link owned by another user "
                           f"(uid {info.st_uid}), who chose where it points; remove it or write elsewhere")
        followed += 1
        if followed > 40:  # as the kernel's ELOOP
            raise NmtError(f"cannot write {path}: too many levels of symbolic links")
        target = Path(os.readlink(candidate))
        pending = list(target.parts[1:] if target.is_absolute() else target.parts) + pending
        resolved = Path("/") if target.is_absolute() else resolved
    return resolved


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether writing ``a`` would replace file ``b``: one regular file (a hard or symbolic link to it),
    or, for a path that does not exist yet, the same path once symlinks are resolved. "-" (stdin or
    stdout) and devices, written in place (``atomic_write``), replace nothing."""
    if "-" in (str(a), str(b)):
        return False
    try:
        return stat.S_ISREG(os.stat(a).st_mode) and os.path.samefile(a, b)
    except OSError:  # ``a`` is new (or ``b`` is gone)
        return not os.path.exists(a) and os.path.realpath(a) == os.path.realpath(b)


def is_zip_file(path: Path) -> bool:
    """Whether ``path`` is a regular file that starts as a zip archive does: what torch.save writes
    (checkpoints)."""
    return regular_file_head(path, 4) == b"PK\x03\x04"


def regular_file_head(path: Path, size: int, follow_links: bool = True) -> bytes | None:
    """The first ``size`` bytes of ``path`` if it is a regular file, else None (not there, unreadable, a
    FIFO, a device; with ``follow_links`` off, a symlink). Opened without waiting (a FIFO would wait for
    a writer), then checked and read through that one descriptor, so nothing swapped in meanwhile is read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as handle:
            return handle.read(size) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None


def refuse_overwriting(flag: str, output: str | os.PathLike | None,
                       inputs: dict[str, str | os.PathLike | Iterable[str | os.PathLike] | None]) -> None:
    """An output that is also one of the command's inputs (``{flag: path or paths}``) would be
    destroyed by the write: refuse it before any work."""
    if output is None:
        return
    for name, paths in inputs.items():
        for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths or []:
            if same_file(output, path):
                raise NmtError(f"{flag} {output} is also the {name}: writing it would destroy it; choose another path")


@contextlib.contextmanager
def _reported(path: Path) -> Iterator[None]:
    """Turn a write failure (also one chained inside another error) into ``cannot write PATH: reason``."""
    try:
        yield
    except NmtError:
        raise
    except Exception as exc:
        error = os_error_of(exc)
        if error is None:
            raise
        raise cannot_write(path, error) from exc


def temp_file_pattern(name: str) -> str:
    """The glob matching atomic_write's temp files for ``name`` (a glob itself)."""
    return f".{name}.*.tmp"


def remove_stale(paths: Iterable[Path], what: str) -> None:
    """Delete what an interrupted run left behind, saying how much it was."""
    removed, size = 0, 0
    for path in paths:
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                size += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
            else:
                size += path.stat().st_size
                path.unlink()
            removed += 1
    if removed:
        logger.info("removed %d stale %s left by an interrupted run (%.1f MB)", removed, what, size / 1e6)


_held_locks: dict[Path, int] = {}


def lock_directory(directory: Path) -> bool:
    """Take an exclusive ``flock`` on a directory until ``unlock_directory`` (or this process ends).

    Returns True when taken (or already held by this process), False when another process holds
    it. The OS releases it when the process dies, so a kill -9 never leaves a stale lock, and
    no lock file is left behind.
    """
    directory = directory.resolve()
    if directory in _held_locks:
        return True
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise NmtError(f"cannot use {directory}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held_locks[directory] = fd
    return True


def unlock_directory(directory: Path) -> None:
    fd = _held_locks.pop(directory.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def lock_holder(directory: Path) -> str:
    """The pid holding the flock on ``directory``, from /proc/locks (Linux), for the error message."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        info = directory.stat()
        inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if fields[1] == "FLOCK" and fields[5] == inode:
                return f"pid {fields[4]}"
    return "another process"


@contextlib.contextmanager
def atomic_directory(destdir: Path) -> Iterator[Path]:
    """A new empty directory to fill, renamed to ``destdir`` when the block ends without error and
    deleted when it does not: ``destdir`` is never seen half-written (``atomic_write`` for a directory).

    It is made beside ``destdir`` as ``.NAME.tmp-*`` (same filesystem: the rename is atomic), when
    entering, so an unwritable place fails before the work; a kill -9 may leave it, for
    ``clean_workdirs_beside``. An old ``destdir`` is moved aside, and deleted once the new one is in place.
    """
    workdir = destdir.parent / f".{destdir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        destdir.parent.mkdir(parents=True, exist_ok=True)
        workdir.mkdir()
    except OSError as exc:
        raise NmtError(f"cannot create a directory in {destdir.parent}: {exc.strerror or exc}") from exc
    try:
        yield workdir
        _replace_directory(workdir, destdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def _replace_directory(new: Path, destdir: Path) -> None:
    """Rename ``new`` to ``destdir``; an old destdir is moved aside first (back on failure) and deleted last."""
    old = None
    if destdir.exists():
        old = destdir.parent / f".{destdir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(destdir, old)
    try:
        os.rename(new, destdir)
    except BaseException:
        if old is not None:
            os.rename(old, destdir)
        raise
    fsync_dir(destdir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_workdirs_beside(destdir: Path) -> None:
    """Remove the ``.NAME.tmp-*`` directories a killed preprocess left beside ``destdir``.

    Only when this process can lock the destdir's parent (kept until it exits): a preprocess
    running there holds that lock, and its directory is not stale.
    """
    if not destdir.parent.is_dir() or not lock_directory(destdir.parent):
        return
    remove_stale(destdir.parent.glob(f".{destdir.name}.tmp-*"), "preprocess directories")


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
    check_readable_file(path)
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as exc:
        raise NmtError(f"cannot read {path}: {exc.strerror or exc}") from exc


def text_lines(handle: IO[bytes], name: str | os.PathLike) -> Iterator[str]:
    """The lines of an open binary file without their line ends; bad UTF-8 is reported with its line.

    Lines are split on "\\n" only (as ``wc -l`` counts them) and decoded one by one, so the
    line number in an error is exact (a text wrapper decodes whole chunks ahead of the line).
    A leading byte-order mark is dropped, with a warning.
    """
    line_no = 0
    try:
        for line_no, raw in enumerate(handle, start=1):
            line = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
            if line_no == 1 and line.startswith("\ufeff"):  # Windows editors write one; it is not text
                line = line[1:]
                logger.warning("%s starts with a UTF-8 byte-order mark: ignored it", name)
            yield line
    except UnicodeDecodeError as exc:
        raise NmtError(f"{name}: line {line_no} is not valid UTF-8 ({exc.reason})") from exc
    except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a .gz damaged inside its deflate stream
        raise NmtError(f"cannot read {name}: {exc}") from exc


def require_files(named: dict[str, str | None]) -> None:
    """Fail before any work on a file an option names that is not there, naming the option (--ban
    FILE): a missing input should not cost a model load first. None and "-" (stdin) pass."""
    for option, path in named.items():
        if path is not None and path != "-":
            check_readable_file(Path(path), option)


def check_readable_file(path: Path, option: str | None = None) -> None:
    """A path that should name a file: missing or a directory is an error naming the option, if any."""
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative paths are read from the working directory {Path.cwd()})"
        raise NmtError(f"{option} not found: {path}{where}" if option else f"file not found: {path}")
    if path.is_dir():
        raise NmtError(f"{option} expects a file, got a directory: {path}" if option
                       else f"expected a file, got a directory: {path}")


def read_lines(path: str | os.PathLike) -> list[str]:
    """All lines of a text file (see ``text_lines``); "-" reads stdin (left open)."""
    stdin = str(path) == "-"
    with contextlib.nullcontext(sys.stdin.buffer) if stdin else open_binary(path) as handle:
        return list(text_lines(handle, "stdin" if stdin else path))


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict:
    """A YAML file that must hold a mapping (empty file: {}); ``what`` names it in errors ("recipe").
    A key given twice in one mapping is an error: YAML loaders keep the last one silently."""
    import yaml  # only the commands that read recipes pay for it

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):  # the loader itself refuses it
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(problem=f"{key!r} is given twice",
                                                            problem_mark=key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    path = Path(path)
    try:
        document = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
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
