"""Where a model runs and in which precision: the options every command that runs a model shares,
declared once. Torch-free, so that building the command line (`nmt --help`) does not import torch;
the hardware checks (is there a GPU, does it compute bf16) are nmt/device.py's, at run time."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from nmt.errors import NmtError
from nmt.options import check_values

Precision = Literal["auto", "fp32", "bf16", "fp16"]
PANEL = "Device"
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
BLEU_TOLERANCE = 0.2  # BLEU points a faster setting may lose in a model's validation check and still be its auto


@dataclass(frozen=True)
class DeviceOptions:
    """Device and autocast precision (training and inference)."""

    device: str = field(default="auto", metadata={
        "help": "auto (the GPU when there is one), cpu, cuda or cuda:N.", "panel": PANEL})
    precision: Precision = field(default="auto", metadata={
        "help": "Autocast precision; auto: bf16 where the hardware runs it natively (bf16 GPUs, CPUs with avx512_bf16 "
                "or amx_bf16), else fp32; fp16 is for GPUs (training adds a dynamic loss scale).", "panel": PANEL})
    threads: int | None = field(default=None, metadata={
        "help": "CPU threads torch computes with (intra-op), in all: --workers (generate), --nproc and "
                "--cpu-processes (train) share them, at least one each. Unset: as torch chooses (OMP_NUM_THREADS, "
                "else one per core).",
        "min": 1, "panel": PANEL})

    def __post_init__(self) -> None:
        check_values(self)
        if not DEVICE_NAME.fullmatch(self.device):
            raise NmtError(f"unknown device {self.device!r}; use cpu, cuda, cuda:N or auto")
        if self.device == "cpu" and self.precision == "fp16":
            raise NmtError("fp16 autocast is for GPUs; on CPU use --precision bf16")


@dataclass(frozen=True)
class InferenceDeviceOptions(DeviceOptions):
    """Device and precision for translating, and CPU int8 quantization."""

    quantize: Literal["auto", "none", "int8"] = field(default="auto", metadata={
        "help": "int8: every nn.Linear layer, the output projection included, in int8 (a scale per weight row, "
                "and per row of activations, quantized as they come; CPU only; computes in fp32). auto: int8 on CPU "
                f"where the checkpoint's validation check kept BLEU (within {BLEU_TOLERANCE}; `nmt average` and "
                "training's end record it) and --precision is auto or fp32, else none.",
        "panel": PANEL})
    backend: Literal["auto", "torch"] = field(default="auto", metadata={
        "help": "What decoding computes with. auto: nmt's C kernels on a CPU where they can be built (faster: "
                "docs/performance.md; `nmt build-kernels` builds them ahead), else PyTorch's operations; torch: "
                "PyTorch's operations only (the same translations in fp32; NMT_CPU_KERNELS=0 does the same).",
        "panel": PANEL})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantize == "int8" and self.device not in ("cpu", "auto"):
            raise NmtError("--quantize int8 is for CPU inference (dynamic quantization); use --precision on GPU")
        if self.quantize == "int8" and self.precision not in ("auto", "fp32"):
            raise NmtError(f"--quantize int8 computes in fp32: give --precision fp32 or auto, not {self.precision}")
