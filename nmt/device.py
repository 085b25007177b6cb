"""Device choice and autocast precision, shared by train and generate."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import ContextManager, Iterator

import torch

from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 matrix instructions; without them oneDNN emulates bf16


def resolve_device(name: str) -> torch.device:
    """``auto`` takes the GPU when there is one; asking for CUDA without one is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise NmtError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
    elif name != "cpu":
        raise NmtError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto")
    return torch.device(name)


def use_threads(threads: int | None, processes: int = 1) -> None:
    """--threads: torch's intra-op threads, ``threads`` in all shared by this machine's ``processes``
    (at least one each), set before a model is built; None leaves torch's own count (OMP_NUM_THREADS,
    else one per core)."""
    if threads is not None:
        torch.set_num_threads(max(1, threads // processes))


@contextlib.contextmanager
def using_threads(threads: int | None, processes: int = 1) -> Iterator[None]:
    """``use_threads`` for the body only: a library call (generate, train) leaves its caller's count
    as it found it."""
    previous = torch.get_num_threads()
    use_threads(threads, processes)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cpu_info() -> dict[str, str]:
    """The first processor's entry of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    entry = text.split("\n\n")[0]
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in entry.splitlines())}


def cpu_flags() -> set[str]:
    """The instruction-set flags the kernel reports for this CPU."""
    return set(cpu_info().get("flags", "").split())


def describe_cpu() -> str:
    """For benchmark tables: model, family/model numbers, vector and bf16 capabilities, cores."""
    info, flags = cpu_info(), cpu_flags()
    vector = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else torch.backends.cpu.get_cpu_capability()
    bf16 = "/".join(sorted(set(CPU_BF16_FLAGS) & flags)) or "no avx512_bf16/amx_bf16"
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}), {vector}, {bf16}, {os.cpu_count()} cores")


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """The precision to run in, and why: ``auto`` is bf16 where the hardware computes it natively.

    Native bf16 means a CUDA device that supports it, or a CPU with AVX512_BF16 or AMX; without
    them bf16 matrix products are emulated and were measured slower than fp32 (docs/performance.md
    names the CPUs). fp16 needs a loss scale and loses range, so it is never chosen automatically.
    """
    if precision != "auto":
        return precision, "asked for"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.get_device_capability(device)[0] >= 8:  # Ampere on; before it torch only emulates bf16
            return "bf16", f"auto: {name} supports bf16"
        return "fp32", f"auto: {name} has no native bf16"
    if device.type == "cpu":
        found = sorted(set(CPU_BF16_FLAGS) & cpu_flags())
        if found:
            return "bf16", f"auto: this CPU has {'/'.join(found)}"
        return "fp32", "auto: this CPU has no avx512_bf16/amx"
    return "fp32", f"auto: no bf16 detection for {device.type} devices"


def autocast(device: torch.device, precision: str) -> ContextManager:
    """Mixed precision through torch.amp: bf16 works on CPU and GPU, fp16 on GPU only."""
    if precision == "auto":
        precision, _ = resolve_precision(precision, device)
    if precision not in PRECISIONS:
        raise NmtError(f"unknown precision {precision!r}; use one of auto, {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    if device.type == "cpu" and dtype is torch.float16:
        raise NmtError("fp16 autocast is for GPUs; on CPU use --precision bf16")
    return torch.autocast(device_type=device.type, dtype=dtype)


def inference_device(options: InferenceDeviceOptions, engine: str = "nmt") -> tuple[torch.device, str, str]:
    """Where and in which precision to decode, and why. int8 (dynamic quantization) runs on the CPU
    and computes in fp32, so ``auto`` resolves to cpu/fp32 for it and bf16/fp16 are refused.
    CTranslate2 resolves ``auto`` itself (its kernels, not torch's, decide what runs natively)."""
    if options.quantize == "int8":  # InferenceDeviceOptions checked the device and precision
        return torch.device("cpu"), "fp32", "int8 layers compute in fp32"
    resolved = resolve_device(options.device)
    if engine == "ctranslate2":
        return resolved, options.precision, "CTranslate2 chooses its compute type"
    precision, reason = resolve_precision(options.precision, resolved)
    autocast(resolved, precision)  # an impossible precision fails before the model is loaded
    return resolved, precision, reason

