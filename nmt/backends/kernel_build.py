"""Building nmt's C kernels (kernels.c) for this CPU, and loading them.

They are compiled for this CPU (``-O3 -march=native``) with $CC, else Python's compiler, cc, gcc or
clang, into a cache directory, once per source, compiler and CPU, and found there afterwards.
Decoding builds them when a model is first prepared for it on a CPU (one log line says so; it
takes seconds to a minute); ``nmt build-kernels`` builds them ahead. Without a compiler, decoding
uses PyTorch's operations (nmt/backends/torch_backend.py), with the same translations in fp32.
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
from nmt.log import logger

# -O3 vectorizes the loops; the math flags let it reorder float sums (as any SIMD dot product does)
# without -ffast-math, which would also flush denormals for the whole process.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC"]
COMPILE_SECONDS = 120


@functools.cache
def built_kernels() -> tuple[Kernels | None, str]:
    """The kernels for this CPU, built or found built, or None and why not: asked once per process
    (a failed build is not tried again at every model loaded)."""
    try:
        compiler = find_compiler()
        if compiler is None:
            return None, "no C compiler to build nmt's kernels, which decode faster: install gcc or clang, or set CC"
        return load(built(compiler)), ""
    except Exception as exc:  # noqa: BLE001 - whatever stops the build (a failed compile, no cache), torch's do
        return None, "nmt's kernels could not be built: " + " ".join(str(exc).split())[:300]


def load(path: Path) -> Kernels:
    return Kernels(ctypes.CDLL(str(path)))


def build_ahead() -> str:
    """``nmt build-kernels``: build the kernels now (or find them built); what and where, in one line."""
    compiler = find_compiler()
    if compiler is None:
        raise NmtError("no C compiler to build nmt's kernels: install gcc or clang, or set CC")
    path = built(compiler)
    return f"nmt's C kernels for this CPU ({load(path).describe()}): {path}"


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


def built(compiler: list[str]) -> Path:
    """The shared library for this source, compiler and CPU: from the cache when it is there whole
    (its SHA-256 as recorded beside it: loading a damaged one could crash the process), else built."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *compiler, version, " ".join(FLAGS), platform.machine(),
                                    cpu_description()]).encode()).hexdigest()[:16]
    name = f"cpu_kernels-{key}.so"
    directories = cache_directories()
    for directory in directories:
        target = directory / name
        if is_whole(target) and (directory != directories[-1] or is_private(directory)):
            logger.debug("nmt's C kernels: %s", target)  # the usual case: said with -v
            return target
    directory = writable_cache_directory(directories)
    target = directory / name
    logger.info("building nmt's C kernels with %s into %s (once per compiler and CPU, up to a minute; "
                "`nmt build-kernels` builds them ahead)", " ".join(compiler), directory)
    with tempfile.TemporaryDirectory(dir=directory) as work:  # another process may build it at the same time
        library_file = Path(work) / name
        result = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(library_file), "-lm"],
                                capture_output=True, text=True, timeout=COMPILE_SECONDS)
        if result.returncode != 0 or not library_file.exists():
            raise OSError(result.stderr or f"{' '.join(compiler)} exited with {result.returncode} and no library")
        digest = Path(work) / (name + ".sha256")
        digest.write_text(sha256_of(library_file))
        os.replace(library_file, target)
        os.replace(digest, target.with_name(name + ".sha256"))
    return target


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_whole(path: Path) -> bool:
    try:
        return path.with_name(path.name + ".sha256").read_text().strip() == sha256_of(path)
    except OSError:
        return False


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
    ~/.cache), then a directory of the temporary one that only this user owns and can write
    (for a read-only or missing home: a library there is loaded and run)."""
    directories = []
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        directories.append((Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "nmt" / "kernels")
    except RuntimeError:  # no home directory at all
        pass
    directories.append(Path(tempfile.gettempdir()) / f"nmt-kernels-{os.getuid()}")
    return directories


def writable_cache_directory(directories: list[Path]) -> Path:
    """The first of ``directories`` (cache_directories) that can be written, the private one last."""
    first, private = directories[0], directories[-1]
    if first != private:
        try:
            first.mkdir(parents=True, exist_ok=True)
            if os.access(first, os.W_OK):
                return first
        except OSError:
            pass
    private.mkdir(mode=0o700, exist_ok=True)
    if not is_private(private):
        raise OSError(f"{private} is not a directory of this user's alone: not loading code from it")
    return private


def is_private(directory: Path) -> bool:
    """A directory that this user owns and nobody else may write into."""
    info = directory.lstat()
    shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not shared
