"""nmt's C kernels (kernels.c), called through the prototypes written there.

ctypes calls a C function with whatever it is given, and a wrong argument type or a tensor of the
wrong dtype is memory read or written at random. So nothing about a kernel's arguments is typed by
hand: each exported function's prototype is read from kernels.c (its own declaration, the one the
compiler checks), its ctypes argument types are made from it, and every call goes through
:meth:`Kernels.call`, which checks that each pointer gets a contiguous CPU tensor of the C type's
dtype (None only where the C side marks the pointer ``NULLABLE``). Each wrapper below checks its
tensors' shapes against each other at its top, so that no kernel reads past a tensor's end. The two
products that run at every decoding step with the same tensors (an int8 layer's weight, a batch's
shortlist) check those once, as call would, and then only x at each call: Int8Product and
Int8ColumnProduct.

Why this and not cffi's ``cdef`` or ``torch.library`` custom ops: the same prototypes with no new
dependency, and no dispatcher on the way (a Python custom op costs microseconds per call, and a
decoding step makes a few dozen of these calls).
"""

from __future__ import annotations

import ctypes
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("kernels.c")
EXPORTED = re.compile(r"^(void|int) (\w+)\(([^)]*)\) \{", re.MULTILINE)  # non-static, at the start of a line
NUMBERS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int}
POINTED = {"float": (torch.float32,), "uint16_t": (torch.bfloat16,), "int64_t": (torch.int64,),
           "int32_t": (torch.int32,), "uint8_t": (torch.bool, torch.uint8), "int8_t": (torch.int8,)}


@dataclass(frozen=True)
class Parameter:
    name: str
    dtypes: tuple[torch.dtype, ...]  # a pointer's: the tensor dtypes that hold its C type; () for a number
    nullable: bool = False


@dataclass(frozen=True)
class Prototype:
    name: str
    parameters: tuple[Parameter, ...]
    ctypes: tuple[type, ...]  # the argument types ctypes converts to
    returns: type | None


def prototypes(source: str) -> dict[str, Prototype]:
    """The exported functions of a C source, by name, from their declarations."""
    found = {}
    for returns, name, text in EXPORTED.findall(source):
        parameters, types = [], []
        for declaration in [part for part in text.split(",") if part.strip() not in ("", "void")]:
            words = declaration.replace("*", " * ").split()
            base = next(word for word in words if word not in ("const", "NULLABLE", "*"))
            if "*" in words:
                parameters.append(Parameter(words[-1], POINTED[base], "NULLABLE" in words))
                types.append(ctypes.c_void_p)
            else:
                parameters.append(Parameter(words[-1], ()))
                types.append(NUMBERS[base])
        found[name] = Prototype(name, tuple(parameters), tuple(types), None if returns == "void" else NUMBERS[returns])
    return found


class Kernels:
    """The kernels of one loaded library (kernel_build.py builds and loads it for this CPU)."""

    def __init__(self, library: ctypes.CDLL):
        self.functions: dict[str, tuple[Prototype, Any]] = {}
        # per function: the C function, its argument count and, for each pointer, (position, dtypes,
        # nullable): what call checks, worked out once (a call is on every layer of every decoding step)
        self.checks: dict[str, tuple[Any, int, tuple[tuple[int, tuple[torch.dtype, ...], bool], ...]]] = {}
        for name, prototype in prototypes(SOURCE.read_text()).items():
            function = getattr(library, name)
            function.argtypes, function.restype = list(prototype.ctypes), prototype.returns
            self.functions[name] = prototype, function
            pointers = tuple((i, p.dtypes, p.nullable) for i, p in enumerate(prototype.parameters) if p.dtypes)
            self.checks[name] = function, len(prototype.parameters), pointers
        self.local = threading.local()  # each thread's scratch buffers: see scratch
        self.attention_avx512 = bool(self.call("attention_avx512"))
        self.int8_vnni = bool(self.call("int8_vnni"))  # the int8 kernels' VNNI instructions

    def describe(self, int8: bool = True) -> str:
        """Which of their instruction sets this build has (``int8``: its int8 products' too), for the log
        line that names the backend."""
        attention = "AVX-512 attention" if self.attention_avx512 else "attention in plain loops"
        if not int8:
            return attention
        return f"{attention}, {'AVX512-VNNI int8' if self.int8_vnni else 'int8 without AVX512-VNNI'}"

    def call(self, name: str, *args: Any) -> Any:
        """The kernel ``name`` on ``args``, in its prototype's order: a tensor (or None, where NULLABLE)
        for each pointer, a Python number for each number."""
        function, count, pointers = self.checks[name]
        if len(args) != count:
            raise TypeError(f"{name} takes {count} arguments, got {len(args)}")
        values = list(args)  # numbers as they are: ctypes refuses what is not a number
        for i, dtypes, nullable in pointers:
            arg = values[i]
            if isinstance(arg, Tensor) and arg.dtype in dtypes and arg.is_contiguous() and arg.is_cpu:
                values[i] = arg.data_ptr()
            elif arg is not None or not nullable:
                raise self.refused(name, self.functions[name][0].parameters[i], arg)
        return function(*values)

    def pointer(self, name: str, parameter: str, tensor: Tensor) -> int:
        """The address of ``tensor`` for the pointer ``parameter`` of kernel ``name``, checked as call
        checks it (for arguments checked once and passed to many calls: Int8Product)."""
        found = next(p for p in self.functions[name][0].parameters if p.name == parameter)
        if not (isinstance(tensor, Tensor) and tensor.dtype in found.dtypes and tensor.is_contiguous() and
                tensor.is_cpu):
            raise self.refused(name, found, tensor)
        return tensor.data_ptr()

    @staticmethod
    def refused(name: str, parameter: Parameter, arg: Any) -> ValueError:
        got = f"{arg.dtype} on {arg.device}{'' if arg.is_contiguous() else ', not contiguous'}" \
            if isinstance(arg, Tensor) else type(arg).__name__
        return ValueError(f"{name}: {parameter.name} takes a contiguous CPU tensor of "
                          f"{' or '.join(map(str, parameter.dtypes))}, got {got}")

    def scratch(self, name: str, size: int, dtype: torch.dtype) -> Tensor:
        """A buffer of at least ``size`` elements that a kernel only writes and reads within one call
        (int8_linear's quantized rows, attention's scores): this thread's, kept for its next calls
        (a torch.empty per call was a fifth of a small batch's Python time per kernel call). A kernel
        is given the whole buffer and uses its start."""
        buffer = getattr(self.local, name, None)
        if buffer is None or buffer.numel() < size:
            with torch.inference_mode(False):  # a normal tensor, whatever mode the first call is in
                buffer = torch.empty(max(size, 2 * (0 if buffer is None else buffer.numel())), dtype=dtype)
            setattr(self.local, name, buffer)
        return buffer

    def append_position(self, cache: Tensor, start: int, keys: Tensor, values: Tensor) -> None:
        """Write keys and values (rows, heads, 1, head_dim) into slots start..start+rows-1 of ``cache``
        (slots, 2, heads, head_dim), float32 or bf16 (rounded to nearest even, as torch rounds)."""
        keys, values = keys.float().contiguous(), values.float().contiguous()  # slices of a fused product: copied
        rows, heads, _, head_dim = keys.shape
        check_shapes("append_position", keys=(keys, (rows, heads, 1, head_dim)), values=(values, keys.shape),
                     cache=(cache, (max(cache.size(0), start + rows), 2, heads, head_dim)))
        name = "append_position_bf16" if cache.dtype == torch.bfloat16 else "append_position"
        self.call(name, cache, start, rows, heads * head_dim, keys, values)

    def self_attention(self, cache: Tensor, starts: Tensor, history: Tensor, length: int, query: Tensor) -> Tensor:
        """One query per row (rows, heads, head_dim) over the first ``length`` positions of ``cache``
        (slots, 2, heads, head_dim), float32 or bf16: row r reads slot ``starts[p] + history[p, r]`` at
        position p; the sums are float32's either way."""
        rows, heads, head_dim = query.shape
        check_shapes("self_attention", cache=(cache, (cache.size(0), 2, heads, head_dim)),
                     starts=(starts, (max(starts.numel(), length + 1),)),
                     history=(history, (max(history.size(0), length), rows)))
        if int(starts[length]) > cache.size(0):
            raise ValueError(f"self_attention: {length} positions end at slot {int(starts[length])} of "
                             f"{cache.size(0)}")
        query32 = query.float().contiguous()
        out = torch.empty_like(query32)
        scores = self.scratch("scores", rows * heads * length, torch.float32)
        name = "self_attention_bf16" if cache.dtype == torch.bfloat16 else "self_attention"
        self.call(name, cache, starts, history, length, rows, heads, head_dim, query32, out, scores)
        return out.to(query.dtype)

    def grouped_attention(self, keys: Tensor, values: Tensor, allowed: Tensor, query: Tensor,
                          rows: Tensor | None = None) -> Tensor:
        """Queries (sentences, group, heads, head_dim), each group to its sentence's keys and values
        (stored, heads, length, head_dim) where ``allowed`` (sentences, length) is True: sentence s's are
        row ``rows[s]`` (without ``rows``, row s)."""
        sentences, group, heads, head_dim = query.shape
        stored, _, length, _ = keys.shape
        check_shapes("grouped_attention", keys=(keys, (stored, heads, length, head_dim)), values=(values, keys.shape),
                     allowed=(allowed, (sentences, length)),
                     rows=(rows, (sentences,)) if rows is not None else (keys, keys.shape))
        if rows is None and sentences != stored or rows is not None and rows.numel() and \
                not 0 <= int(rows.min()) <= int(rows.max()) < stored:
            raise ValueError(f"grouped_attention: rows for {sentences} sentences of {stored} stored")
        keys, values = keys.float().contiguous(), values.float().contiguous()  # as encode gives them: no copy
        query32 = query.float().contiguous()
        out = torch.empty_like(query32)
        scores = self.scratch("scores", length, torch.float32)
        rows = None if rows is None else rows.to(torch.int64).contiguous()
        self.call("grouped_attention", keys, values, allowed.to(torch.bool).contiguous(), rows, sentences, group,
                  heads, length, head_dim, query32, out, scores)
        return out.to(query.dtype)

    def log_softmax_(self, logits: Tensor, banned: Tensor | None, sentences: Tensor) -> Tensor:
        """In place, each row of ``logits`` (rows, columns) to log-probabilities over the columns it may
        choose: the rows belong to ``sentences`` (rows of ``banned``, as many rows each), and with
        ``banned`` (0 or -inf per column for each sentence of a batch) lose their -inf columns."""
        rows, columns = logits.shape
        if banned is None:
            self.call("log_softmax_rows", logits, rows, columns, None, None, 1)
            return logits
        banned, sentences = banned.float().contiguous(), sentences.long().contiguous()
        check_shapes("log_softmax_rows", banned=(banned, (banned.size(0), columns)))
        if not len(sentences) or rows % len(sentences) or int(sentences.max()) >= len(banned) or \
                int(sentences.min()) < 0:
            raise ValueError(f"log_softmax_rows: {rows} rows for {len(sentences)} of {len(banned)} sentences")
        self.call("log_softmax_rows", logits, rows, columns, banned, sentences, rows // len(sentences))
        return logits

    def select_top(self, scores: Tensor, logprobs: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
        """The ``count`` best (score + log-probability, row, column) per sentence, best first: ``scores``
        (sentences, width) and ``logprobs`` (sentences * width, columns), as TorchBackend.select_top."""
        sentences, width = scores.shape
        check_shapes("select_top", logprobs=(logprobs, (sentences * width, logprobs.size(1))))
        scores = scores.float().contiguous()
        best = torch.empty(sentences, count, dtype=torch.float32)
        rows = torch.empty(sentences, count, dtype=torch.int64)
        columns = torch.empty(sentences, count, dtype=torch.int64)
        self.call("select_top", logprobs, scores, sentences, width, logprobs.size(1), count, best, rows, columns)
        return best, rows, columns

    def project_columns_int8(self, x: Tensor, weight: Tensor, columns: Tensor, column_sums: Tensor,
                             column_scales: Tensor, counts: Tensor) -> Tensor:
        """Logits (..., width) of x (..., dim) for each sentence's own vocabulary entries: ``columns``
        (sentences, width) are rows of ``weight`` (vocabulary, dim) int8, ``column_sums`` their sums
        (int32) and ``column_scales`` their scales (float32), ``counts`` (sentences,) how many of each
        sentence's are its own (-inf after; ids below the weight's rows); x's rows come as many per
        sentence, consecutive. Each row of x is quantized to int8 with a scale of its own. (A batch
        calls its Int8ColumnProduct, made once.)"""
        return self.int8_column_product(weight, columns, column_sums, column_scales, counts)(x)

    def int8_column_product(self, weight: Tensor, columns: Tensor, column_sums: Tensor, column_scales: Tensor,
                            counts: Tensor) -> Int8ColumnProduct:
        """project_columns_int8 for one batch's columns, as a function of x (see Int8ColumnProduct)."""
        return Int8ColumnProduct(self, weight, columns, column_sums, column_scales, counts)

    def pack_int8_weight(self, weight: Tensor) -> Tensor:
        """An int8 weight (outputs, inputs) in the layout int8_linear reads (kernels.c: panels of 64
        outputs, groups of 4 inputs), outputs rounded up to 16 and inputs to 4 with zeros."""
        outputs, inputs = weight.shape
        packed = torch.empty(round_up(outputs, 16) * round_up(inputs, 4), dtype=torch.int8)
        self.call("pack_int8_weight", weight.to(torch.int8).contiguous(), outputs, inputs, packed)
        return packed

    def int8_product(self, packed: Tensor, inputs: int, outputs: int, weight_sums: Tensor, scales: Tensor,
                     bias: Tensor, relu: bool) -> Int8Product:
        """int8_linear's product for one weight, as a function of x (see Int8Product)."""
        return Int8Product(self, packed, inputs, outputs, weight_sums, scales, bias, relu)

    def int8_linear(self, x: Tensor, packed: Tensor, outputs: int, weight_sums: Tensor, scales: Tensor,
                    bias: Tensor, relu: bool) -> Tensor:
        """x (..., inputs) float32 times the int8 weight that ``packed`` holds (pack_int8_weight), each
        row of x quantized with a scale of its own: (..., outputs) float32, the ReLU in the same pass.
        ``weight_sums`` (the weight rows' sums, int32), ``scales`` and ``bias`` (float32) per output,
        outputs rounded up to 16 with zeros. (A layer calls its Int8Product, made once.)"""
        return self.int8_product(packed, x.shape[-1], outputs, weight_sums, scales, bias, relu)(x)

    def int8_quantize_rows(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (rows, dim) float32 as int8_linear quantizes them: int8 values
        q = round(x * 127 / max |x|) (rows, dim) and each row's scale, max |x| / 127 (NaN for a row
        with an inf or a NaN, whose q are 0)."""
        rows, dim = x.shape
        quantized = torch.empty(rows, dim, dtype=torch.uint8)  # the C side writes bytes: q itself (offset 0)
        row_scales = torch.empty(rows, dtype=torch.float32)
        self.call("int8_quantize_rows", x, rows, dim, dim, 0, quantized, row_scales)
        return quantized.view(torch.int8), row_scales

    def int8_scale_outputs(self, sums: Tensor, row_scales: Tensor, scales: Tensor, bias: Tensor,
                           relu: bool) -> Tensor:
        """Outputs (rows, columns) float32 from the integer sums (rows, columns, int32) of q * w, as
        int8_linear makes them: sum * (row scale * column scale) + bias in one rounding, the ReLU
        after where asked."""
        rows, columns = sums.shape
        check_shapes("int8_scale_outputs", row_scales=(row_scales, (rows,)), scales=(scales, (columns,)),
                     bias=(bias, (columns,)))
        out = torch.empty(rows, columns, dtype=torch.float32)
        self.call("int8_scale_outputs", sums, rows, columns, row_scales, scales, bias, int(relu), out)
        return out


class Int8Product:
    """int8_linear (Kernels.int8_linear) for one int8 layer, called at every decoding step: its weight's
    tensors, which never change, are checked once, here, and a call checks only x. Checking all twelve
    arguments at each call (Kernels.call) was a third of the Python time of a product of a few rows."""

    def __init__(self, kernels: Kernels, packed: Tensor, inputs: int, outputs: int, weight_sums: Tensor,
                 scales: Tensor, bias: Tensor, relu: bool):
        padded, self.padded_inputs = round_up(outputs, 16), round_up(inputs, 4)
        check_shapes("int8_linear", packed=(packed, (padded * self.padded_inputs,)),
                     weight_sums=(weight_sums, (padded,)), scales=(scales, (padded,)), bias=(bias, (padded,)))
        self.kernels, self.function = kernels, kernels.checks["int8_linear"][0]
        self.tensors = packed, weight_sums, scales, bias  # held, so that the addresses below stay theirs
        self.addresses = [kernels.pointer("int8_linear", name, tensor) for name, tensor in
                          zip(("packed", "weight_sums", "scales", "bias"), self.tensors)]
        self.inputs, self.outputs, self.relu = inputs, outputs, int(relu)

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., inputs), a contiguous float32 CPU tensor: (..., outputs) float32."""
        shape = x.shape
        if not (isinstance(x, Tensor) and shape and shape[-1] == self.inputs and x.dtype == torch.float32 and
                x.is_contiguous() and x.is_cpu):
            found = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"int8_linear: x takes a contiguous float32 CPU tensor (..., {self.inputs}), got {found}")
        rows = x.numel() // self.inputs if self.inputs else 0
        out = torch.empty(shape[:-1] + (self.outputs,), dtype=torch.float32)
        quantized = self.kernels.scratch("quantized", rows * self.padded_inputs, torch.uint8)
        row_scales = self.kernels.scratch("row_scales", rows, torch.float32)
        packed, weight_sums, scales, bias = self.addresses
        self.function(x.data_ptr(), rows, self.inputs, packed, self.outputs, weight_sums, scales, bias, self.relu,
                      out.data_ptr(), quantized.data_ptr(), row_scales.data_ptr())
        return out


class Int8ColumnProduct:
    """project_columns_int8 (Kernels.project_columns_int8) for one batch's columns, called at every
    decoding step: the weight, the columns (that they are rows of the weight: a pass over all of them)
    and their sums and counts are checked once, here, when the batch's shortlist is made or narrowed;
    a call checks only x."""

    def __init__(self, kernels: Kernels, weight: Tensor, columns: Tensor, column_sums: Tensor, column_scales: Tensor,
                 counts: Tensor):
        self.sentences, self.width = columns.shape
        weight, columns = weight.to(torch.int8).contiguous(), columns.to(torch.int64).contiguous()
        column_sums, counts = column_sums.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()
        column_scales = column_scales.float().contiguous()
        self.dim = weight.size(-1)
        check_shapes("project_columns_int8", weight=(weight, (weight.size(0), self.dim)),
                     column_sums=(column_sums, columns.shape), column_scales=(column_scales, columns.shape),
                     counts=(counts, (self.sentences,)))
        if columns.numel() and not 0 <= int(columns.min()) <= int(columns.max()) < len(weight):
            raise ValueError(f"project_columns_int8: columns outside the weight's {len(weight)} rows")
        self.kernels, self.function = kernels, kernels.checks["project_columns_int8"][0]
        self.tensors = weight, columns, column_sums, column_scales, counts  # held: the addresses below stay theirs
        self.addresses = [kernels.pointer("project_columns_int8", name, tensor) for name, tensor in
                          zip(("weight", "columns", "column_sums", "column_scales", "counts"), self.tensors)]

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., dim), its rows as many per sentence: (..., width) float32."""
        if not x.dim() or x.size(-1) != self.dim:
            raise ValueError(f"project_columns_int8: shapes that do not fit together: x {tuple(x.shape)}, weight "
                             f"({len(self.tensors[0])}, {self.dim})")
        if not x.is_cpu:
            raise ValueError(f"project_columns_int8: x takes a CPU tensor, got one on {x.device}")
        rows = x.float().contiguous()  # what the kernel reads: float32, contiguous
        count = rows.numel() // self.dim if self.dim else 0
        if count % self.sentences:
            raise ValueError(f"project_columns_int8: {count} rows for {self.sentences} sentences")
        out = torch.empty(x.shape[:-1] + (self.width,), dtype=torch.float32)
        quantized = self.kernels.scratch("quantized", (self.dim + 63) // 64 * 64, torch.uint8)  # one row at a time
        weight, columns, column_sums, column_scales, counts = self.addresses
        self.function(rows.data_ptr(), self.sentences, count // self.sentences, self.dim, weight, columns,
                      column_sums, column_scales, counts, self.width, out.data_ptr(), quantized.data_ptr())
        return out


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def check_shapes(kernel: str, **tensors: tuple[Tensor, tuple[int, ...]]) -> None:
    """Each named tensor has the shape given beside it; else one error naming them all."""
    for tensor, shape in tensors.values():
        if tensor.shape != shape:  # a torch.Size is a tuple
            found = ", ".join(f"{name} {tuple(tensor.shape)}" for name, (tensor, _) in tensors.items())
            raise ValueError(f"{kernel}: shapes that do not fit together: {found}")
