"""Device choice and autocast precision, shared by train and generate."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Literal

import torch

from nmt.errors import NmtError

Precision = Literal["fp32", "bf16", "fp16"]  # the options' type: their choices
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def autocast(device: torch.device, precision: str) -> ContextManager:
    """Mixed precision through torch.amp: bf16 works on CPU and GPU, fp16 on GPU only."""
    if precision not in PRECISIONS:
        raise NmtError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    if device.type == "cpu" and dtype is torch.float16:
        raise NmtError("fp16 autocast is for GPUs; on CPU use --precision bf16")
    return torch.autocast(device_type=device.type, dtype=dtype)
