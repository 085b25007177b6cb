"""Where nmt's built C kernels are kept, and how one is loaded without trusting what another user could change.

A library in the cache is code that this process runs. So a cache directory must be this user's
alone: created 0700, and checked on a descriptor of it (not a symlink, owned by this user, written
by nobody else). A library in it is opened once, without following a symlink, checked the same
way, hashed from that descriptor against the SHA-256 recorded beside it (a damaged one could crash
the process: the record proves integrity, the owner and mode authorship), and loaded from that
same descriptor: nothing can be swapped in between the check and the load.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
from pathlib import Path

_loaded_descriptors: list[int] = []  # kept open: a library's /proc/self/fd name must never name another file


def private_directory(path: Path, create: bool = False) -> int:
    """A descriptor of ``path``, a directory of this user's alone (made 0700, parents too, with ``create``);
    OSError saying why not."""
    if create:
        missing = []
        for directory in [path, *path.parents]:
            if directory.exists():
                break
            missing.append(directory)
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:  # made meanwhile (another process): checked below like any
                pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        refuse_shared(os.fstat(fd), path)
    except OSError:
        os.close(fd)
        raise
    return fd


def refuse_shared(info: os.stat_result, path: Path | str) -> None:
    """OSError unless ``info`` is of something this user owns and nobody else may write."""
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{path} is not this user's alone (owner uid {info.st_uid}, mode "
                      f"{stat.filemode(info.st_mode)}): not loading code from it")


def open_whole(directory: int, name: str) -> int | None:
    """A descriptor of the library ``name`` in the (checked) directory ``directory``, when it is a regular
    file of this user's alone whose SHA-256 is the one recorded beside it (``name``.sha256); else None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        refuse_shared(info, name)
        if stat.S_ISREG(info.st_mode) and read_record(directory, name + ".sha256") == sha256_of(fd):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_record(directory: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read(256).decode("ascii", "replace").strip()


def sha256_of(fd: int) -> str:
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def load_library(fd: int) -> ctypes.CDLL:
    """The library open on ``fd``, loaded through the descriptor's own name (the file it was opened on,
    whatever its path names now)."""
    proc = f"/proc/self/fd/{fd}"
    library = ctypes.CDLL(proc if os.path.exists(proc) else f"/dev/fd/{fd}")
    _loaded_descriptors.append(fd)
    return library
