"""Building nmt's C kernels (kernels.c) for this CPU, and loading them.

They are compiled for this CPU (``-O3 -march=native``) with $CC, else Python's compiler, cc, gcc or
clang, into a cache directory, once per source, compiler and CPU, and found there afterwards.
Decoding builds them when a model is first prepared for it on a CPU (one log line says so; it
takes seconds to a minute); ``nmt build-kernels`` builds them ahead. Without a compiler, decoding
uses PyTorch's operations (nmt/backends/torch_backend.py), with the same translations in fp32.

A library in the cache is code that this process runs. So a cache directory must be this user's
alone: created 0700, and checked on a descriptor of it (not a symlink, owned by this user, written
by nobody else). A library in it is opened once, without following a symlink, checked the same
way, hashed from that descriptor against the SHA-256 recorded beside it (a damaged one could crash
the process: the record proves integrity, the owner and mode authorship), and loaded from that
same descriptor: nothing can be swapped in between the check and the load.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from nmt.backends.kernels import SOURCE, Kernels
from nmt.errors import NmtError
from nmt.files import sha256_of
from nmt.log import logger

# -O3 vectorizes the loops; the math flags let it reorder float sums (as any SIMD dot product does)
# without -ffast-math, which would also flush denormals for the whole process.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC"]
COMPILE_SECONDS = 120
_loaded_descriptors: list[int] = []  # kept open: a library's /proc/self/fd name must never name another file


@functools.cache
def built_kernels() -> tuple[Kernels | None, str]:
    """The kernels for this CPU, built or found built, or None and why not: asked once per process
    (a failed build is not tried again at every model loaded)."""
    try:
        compiler = find_compiler()
        if compiler is None:
            return None, "no C compiler to build nmt's kernels, which decode faster: install gcc or clang, or set CC"
        return Kernels(built(compiler)[0]), ""
    except Exception as exc:  # noqa: BLE001 - whatever stops the build (a failed compile, no cache), torch's do
        return None, "nmt's kernels could not be built: " + " ".join(str(exc).split())[:300]


def build_ahead() -> str:
    """``nmt build-kernels``: build the kernels now (or find them built); what and where, in one line."""
    compiler = find_compiler()
    if compiler is None:
        raise NmtError("no C compiler to build nmt's kernels: install gcc or clang, or set CC")
    library, path = built(compiler)
    return f"nmt's C kernels for this CPU ({Kernels(library).describe()}): {path}"


def find_compiler() -> list[str] | None:
    """$CC (with its arguments: "ccache gcc"), else Python's own compiler, cc, gcc or clang: the
    first whose program exists. A $CC that does not is an error (it was asked for)."""
    if os.environ.get("CC"):
        try:
            compiler = shlex.split(os.environ["CC"])
        except ValueError as exc:
            raise OSError(f"CC={os.environ['CC']!r}: {exc}") from exc
        if not compiler or not shutil.which(compiler[0]):
            raise OSError(f"CC={os.environ['CC']!r}: {compiler[0] if compiler else 'nothing'} not found")
        return compiler
    for candidate in (sysconfig.get_config_var("CC") or "", "cc", "gcc", "clang"):
        words = shlex.split(candidate) if candidate else []
        if words and shutil.which(words[0]):
            return words
    return None


def library_name(compiler: list[str]) -> str:
    """The library's file name: one per source, compiler and CPU."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *compiler, version, " ".join(FLAGS), platform.machine(),
                                    cpu_description()]).encode()).hexdigest()[:16]
    return f"cpu_kernels-{key}.so"


def built(compiler: list[str]) -> tuple[ctypes.CDLL, Path]:
    """The shared library for this source, compiler and CPU, loaded, and its path: from a cache directory
    when it is there whole and this user's alone, else built into the first such directory."""
    name = library_name(compiler)
    for directory in cache_directories():
        try:
            descriptor = private_directory(directory)
        except OSError:
            continue
        try:
            found = open_whole(descriptor, name)
        finally:
            os.close(descriptor)
        if found is not None:
            logger.debug("nmt's C kernels: %s", directory / name)  # the usual case: said with -v
            return load_library(found), directory / name
    directory, descriptor = writable_cache_directory(cache_directories())
    try:
        logger.info("building nmt's C kernels with %s into %s (once per compiler and CPU, up to a minute; "
                    "`nmt build-kernels` builds them ahead)", " ".join(compiler), directory)
        with tempfile.TemporaryDirectory(dir=directory) as work:  # another process may build it at the same time
            library_file = Path(work) / name
            result = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(library_file), "-lm"],
                                    capture_output=True, text=True, timeout=COMPILE_SECONDS)
            if result.returncode != 0 or not library_file.exists():
                raise OSError(result.stderr or f"{' '.join(compiler)} exited with {result.returncode} and no library")
            os.chmod(library_file, 0o700)  # the compiler gives the umask's mode: maybe group-writable
            with open(library_file, "rb") as handle:
                (Path(work) / "digest").write_text(sha256_of(handle.fileno()))
            os.replace(library_file, name, dst_dir_fd=descriptor)
            os.replace(Path(work) / "digest", name + ".sha256", dst_dir_fd=descriptor)
        found = open_whole(descriptor, name)
        if found is None:
            raise OSError(f"{directory / name} changed as it was written")
        return load_library(found), directory / name
    finally:
        os.close(descriptor)


def cpu_description() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by machines must not mix them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in
                             ("model name", "flags", "Features", "CPU part")}))


def cache_directories() -> list[Path]:
    """Where built kernels are looked for: the user's cache ($XDG_CACHE_HOME when absolute, else
    ~/.cache), then one in the temporary directory (for a read-only or missing home, or a cache
    that is not this user's alone); each is used only as private_directory allows."""
    directories = []
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        directories.append((Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "nmt" / "kernels")
    except RuntimeError:  # no home directory at all
        pass
    directories.append(Path(tempfile.gettempdir()) / f"nmt-kernels-{os.getuid()}")
    return directories


def writable_cache_directory(directories: list[Path]) -> tuple[Path, int]:
    """The first of ``directories`` (cache_directories) that is this user's alone (made so if missing) and
    can be written, with a descriptor of it."""
    reasons = []
    for directory in directories:
        try:
            descriptor = private_directory(directory, create=True)
        except OSError as exc:
            reasons.append(str(exc))
            continue
        if os.access(directory, os.W_OK):
            return directory, descriptor
        os.close(descriptor)
        reasons.append(f"{directory} cannot be written")
    raise OSError("; ".join(reasons))


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


def load_library(fd: int) -> ctypes.CDLL:
    """The library open on ``fd``, loaded through the descriptor's own name (the file it was opened on,
    whatever its path names now)."""
    proc = f"/proc/self/fd/{fd}"
    library = ctypes.CDLL(proc if os.path.exists(proc) else f"/dev/fd/{fd}")
    _loaded_descriptors.append(fd)
    return library
