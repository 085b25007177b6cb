"""Decoding's small operations on CPU in C (nmt/models/cpu_kernels.c), compiled on first use.

One-query attention is a few dozen multiply-adds per (row, head); torch's kernel pays a fixed cost
for each, and beam search with torch's operations copies the self-attention cache every step to
follow the surviving beams. The C kernels read the cache through a table of each row's ancestors
instead (nmt.models.kv_cache.IndexedDecoderCache), and also take the grouped (cross and encoder)
attention, the log-softmax under a shortlist and beam search's top-k. They are compiled for this
CPU (``-O3 -march=native``) with $CC, else Python's compiler, cc, gcc or clang, into a cache
directory of this user's alone (nmt/models/kernel_cache.py), once per source, compiler and CPU;
without a compiler, or with ``NMT_CPU_KERNELS=0``, decoding uses torch's operations and the
copying cache, with the same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from nmt.log import logger
from nmt.models.kernel_cache import load_library, open_whole, private_directory, sha256_of
from nmt.switches import turned_off

SOURCE = Path(__file__).with_suffix(".c")
# -O3 vectorizes the loops; the math flags let it reorder float sums (as any SIMD dot product does)
# without -ffast-math, which would also flush denormals for the whole process.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC"]
COMPILE_SECONDS = 120


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be had; one log line says which and why."""
    if turned_off("NMT_CPU_KERNELS"):
        logger.info("decoding on CPU: torch's operations (NMT_CPU_KERNELS=%s)", os.environ["NMT_CPU_KERNELS"])
        return None
    try:
        compiler = find_compiler()
        if compiler is None:
            logger.info("decoding on CPU: torch's operations (no C compiler to build nmt's kernels, which decode "
                        "faster: install gcc or clang, or set CC)")
            return None
        return bind(built(compiler))
    except Exception as exc:  # noqa: BLE001 - whatever stops the build (a failed compile, no cache), torch's do
        logger.info("decoding on CPU: torch's operations (nmt's kernels could not be built: %s)",
                    " ".join(str(exc).split())[:300])
        return None


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


def usable(x: Tensor) -> bool:
    """Inference (``torch.inference_mode``: decoding, never training's validation) on CPU, where the
    kernels could be built."""
    return x.device.type == "cpu" and torch.is_inference_mode_enabled() and library() is not None


def int8_columns_usable(x: Tensor) -> bool:
    """Where the int8 shortlist projection runs in C: as ``usable``, and built with AVX512-VNNI (its
    16 columns at a time). Without VNNI its plain loops were not measured against fbgemm's product
    onto the batch's union of candidates, which decoding then takes."""
    return usable(x) and bool(library().project_columns_int8_vnni())


def library_name(compiler: list[str]) -> str:
    """The library's file name: one per source, compiler and CPU."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *compiler, version, " ".join(FLAGS), platform.machine(),
                                    cpu_description()]).encode()).hexdigest()[:16]
    return f"cpu_kernels-{key}.so"


def built(compiler: list[str]) -> ctypes.CDLL:
    """The shared library for this source, compiler and CPU, loaded: from a cache directory when it is there
    whole and this user's alone (nmt/models/kernel_cache.py), else built into the first such directory."""
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
            logger.debug("decoding on CPU: nmt's kernels (%s)", directory / name)  # the usual case: said with -v
            return load_library(found)
    directory, descriptor = writable_cache_directory(cache_directories())
    try:
        logger.info("decoding on CPU: building nmt's kernels with %s (once per compiler and CPU) into %s",
                    " ".join(compiler), directory)
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
        return load_library(found)
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
    that is not this user's alone); each is used only as kernel_cache.private_directory allows."""
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


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.self_attention.argtypes = [pointer, pointer, pointer, size, size, size, size, pointer, pointer, pointer]
    lib.grouped_attention.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size, size, pointer,
                                      pointer, pointer]
    lib.self_attention_bf16.argtypes = lib.self_attention.argtypes
    lib.append_position.argtypes = [pointer, size, size, size, pointer, pointer]
    lib.append_position_bf16.argtypes = lib.append_position.argtypes
    lib.log_softmax_rows.argtypes = [pointer, size, size, pointer, pointer, size]
    lib.select_top.argtypes = [pointer, pointer, size, size, size, size, pointer, pointer, pointer]
    lib.project_columns_int8.argtypes = [pointer, size, size, size, pointer, ctypes.c_float, pointer, pointer,
                                         pointer, size, pointer, pointer]
    lib.project_columns_int8_vnni.argtypes = []
    lib.project_columns_int8_vnni.restype = ctypes.c_int
    lib.attention_avx512.argtypes = []
    lib.attention_avx512.restype = ctypes.c_int
    for kernel in (lib.self_attention, lib.self_attention_bf16, lib.grouped_attention, lib.append_position,
                   lib.append_position_bf16, lib.log_softmax_rows, lib.select_top, lib.project_columns_int8):
        kernel.restype = None
    return lib


def append_position(cache: Tensor, start: int, keys: Tensor, values: Tensor) -> None:
    """Write keys and values (rows, heads, 1, head_dim) into slots start..start+rows-1 of ``cache``
    (slots, 2, heads, head_dim), float32 or bf16 (rounded to nearest even, as torch rounds)."""
    keys, values = keys.float().contiguous(), values.float().contiguous()  # slices of a fused product: copied
    kernel = library().append_position_bf16 if cache.dtype == torch.bfloat16 else library().append_position
    kernel(cache.data_ptr(), start, keys.size(0), keys[0].numel(), keys.data_ptr(), values.data_ptr())


def self_attention(cache: Tensor, starts: Tensor, history: Tensor, length: int, query: Tensor) -> Tensor:
    """One query per row (rows, heads, head_dim) over the first ``length`` positions of ``cache``
    (slots, 2, heads, head_dim), float32 or bf16: row r reads slot ``starts[p] + history[p, r]`` at
    position p; the sums are float32's either way."""
    rows, heads, head_dim = query.shape
    query32 = query.float().contiguous()
    out = torch.empty_like(query32)
    scores = torch.empty(rows * heads * length, dtype=torch.float32)
    kernel = library().self_attention_bf16 if cache.dtype == torch.bfloat16 else library().self_attention
    kernel(cache.data_ptr(), starts.data_ptr(), history.data_ptr(), length, rows, heads, head_dim, query32.data_ptr(),
           out.data_ptr(), scores.data_ptr())
    return out.to(query.dtype)


def grouped_attention(keys: Tensor, values: Tensor, allowed: Tensor, query: Tensor,
                      rows: Tensor | None = None) -> Tensor:
    """Queries (sentences, group, heads, head_dim), each group to its sentence's keys and values
    (stored, heads, length, head_dim) where ``allowed`` (stored, length) is True: sentence s's are
    row ``rows[s]`` (without ``rows``, row s)."""
    sentences, group, heads, head_dim = query.shape
    if values.shape != keys.shape or allowed.shape != (keys.size(0), keys.size(2)):
        raise ValueError(f"keys {tuple(keys.shape)}, values {tuple(values.shape)}, allowed {tuple(allowed.shape)}")
    if rows is not None and (rows.shape != (sentences,) or rows.numel() and not
                             0 <= int(rows.min()) <= int(rows.max()) < keys.size(0)):
        raise ValueError(f"rows {tuple(rows.shape)} for {sentences} sentences of {keys.size(0)} stored")
    keys, values = keys.float().contiguous(), values.float().contiguous()  # as encode gives them: no copy
    allowed = allowed.to(torch.bool).contiguous()
    query32 = query.float().contiguous()
    out = torch.empty_like(query32)
    scores = torch.empty(keys.size(2), dtype=torch.float32)
    rows = None if rows is None else rows.to(torch.int64).contiguous()
    library().grouped_attention(keys.data_ptr(), values.data_ptr(), allowed.data_ptr(),
                                None if rows is None else rows.data_ptr(), sentences, group, heads, keys.size(2),
                                head_dim, query32.data_ptr(), out.data_ptr(), scores.data_ptr())
    return out.to(query.dtype)


def log_softmax_(logits: Tensor, banned: Tensor | None = None, sentences: Tensor | None = None) -> Tensor:
    """In place, each row of ``logits`` (rows, columns) to log-probabilities over the columns it may
    choose: with ``banned`` (0 or -inf per column for each sentence of a batch), the rows belong to
    ``sentences`` (rows of ``banned``), as many rows each, and lose their -inf columns. In C on CPU
    where the kernels could be built, else torch's operations."""
    rows, columns = logits.shape
    if banned is not None and sentences is None:
        sentences = torch.arange(len(banned), device=banned.device)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() and library():
        if banned is None:
            library().log_softmax_rows(logits.data_ptr(), rows, columns, None, None, 1)
        else:
            banned, sentences = banned.float().contiguous(), sentences.long().contiguous()
            if banned.size(1) != columns or rows % len(sentences) or int(sentences.max()) >= len(banned):
                raise ValueError(f"{rows} rows of {columns} columns for {len(sentences)} of {tuple(banned.shape)}")
            library().log_softmax_rows(logits.data_ptr(), rows, columns, banned.data_ptr(), sentences.data_ptr(),
                                       rows // len(sentences))
        return logits
    if banned is not None:
        logits.view(len(sentences), -1, columns).add_(banned[sentences].unsqueeze(1))
    return torch.log_softmax(logits, dim=-1, out=logits)


def select_top(scores: Tensor, logprobs: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The ``count`` best (score + log-probability, row, column) per sentence, best first, as
    nmt.generation.search.select_top; None where the kernels cannot take these tensors."""
    sentences, width = scores.shape
    if logprobs.device.type != "cpu" or logprobs.dtype != torch.float32 or not logprobs.is_contiguous() or \
            library() is None:
        return None
    if logprobs.size(0) != sentences * width:
        raise ValueError(f"{logprobs.size(0)} rows of log-probabilities for {sentences} x {width} scores")
    scores = scores.float().contiguous()
    best = torch.empty(sentences, count, dtype=torch.float32)
    rows = torch.empty(sentences, count, dtype=torch.int64)
    columns = torch.empty(sentences, count, dtype=torch.int64)
    library().select_top(logprobs.data_ptr(), scores.data_ptr(), sentences, width, logprobs.size(1), count,
                         best.data_ptr(), rows.data_ptr(), columns.data_ptr())
    return best, rows, columns


def project_columns_int8(x: Tensor, weight: Tensor, weight_scale: float, columns: Tensor, column_sums: Tensor,
                         counts: Tensor) -> Tensor:
    """Logits (..., width) of x (..., dim) for each sentence's own vocabulary entries: ``columns``
    (sentences, width) are rows of ``weight`` (vocabulary, dim) int8 with scale ``weight_scale``,
    ``column_sums`` their sums (int32), ``counts`` (sentences,) how many of each sentence's are its
    own (-inf after; ids below the weight's rows, as Int8Linear.columns checks); x's rows come as
    many per sentence, consecutive. Each row of x is quantized to int8 with a scale of its own."""
    sentences, width = columns.shape
    rows = x.reshape(-1, x.size(-1)).float().contiguous()
    dim = rows.size(1)
    if len(rows) % sentences or weight.dim() != 2 or weight.size(1) != dim or column_sums.shape != columns.shape \
            or counts.shape != (sentences,):
        raise ValueError(f"{len(rows)} rows of {dim} for a weight of {tuple(weight.shape)} and columns, sums and "
                         f"counts of {tuple(columns.shape)}, {tuple(column_sums.shape)}, {tuple(counts.shape)}")
    weight, columns = weight.to(torch.int8).contiguous(), columns.to(torch.int64).contiguous()
    column_sums, counts = column_sums.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()
    out = torch.empty(len(rows), width, dtype=torch.float32)
    quantized = torch.empty((dim + 63) // 64 * 64, dtype=torch.uint8)  # one row at a time
    library().project_columns_int8(rows.data_ptr(), sentences, len(rows) // sentences, dim, weight.data_ptr(),
                                   weight_scale, columns.data_ptr(), column_sums.data_ptr(), counts.data_ptr(),
                                   width, out.data_ptr(), quantized.data_ptr())
    return out.view(*x.shape[:-1], width)
