"""The options of ``nmt export ctranslate2``, torch-free for the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Quantization = Literal["float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                       "bfloat16"]


@dataclass(frozen=True)
class ExportOptions:
    checkpoint: str = field(metadata={"path": True, "help": "The nmt checkpoint to export.", "argument": True,
                                      "metavar": "CHECKPOINT"})
    outdir: str = field(metadata={"path": True,
                                  "help": "The CTranslate2 model directory to write (replaced only once complete).",
                                  "argument": True, "metavar": "OUTDIR"})
    quantization: Quantization = field(default="float32", metadata={
        "help": "Weight type CTranslate2 stores (int8: about 4x smaller; it can still compute in another type)."})
    force: bool = field(default=False, metadata={"help": "Replace OUTDIR if it holds an earlier export."})
