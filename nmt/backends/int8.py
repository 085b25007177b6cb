"""Linear layers in int8 for inference on CPU, each row of a batch quantized on its own.

``quantize(model)`` turns every ``nn.Linear`` into an :class:`Int8Linear`: int8 weights with a scale
per output row (max |w| / 127, as CTranslate2 quantizes them) times activations quantized on the
fly, a scale per row of the batch (max |x| / 127, 8 bits), so that a sentence's outputs never depend
on the other sentences of its batch (fbgemm's dynamic layer quantizes a whole batch with one 7-bit
scale, and a sentence's translation could change with its neighbours). One scale for a whole weight
(torch.ao's dynamic quantization) lets its largest row set the step for all: on the CPU recipe's
model that lost 0.46 BLEU on the validation set against fp32, a scale per row 0.14. With nmt's C kernels
built with AVX512-VNNI, the products run in ``int8_linear``: quantization, product, scales, bias and
ReLU in one call on one thread. Elsewhere, and for large products where torch has more than one
thread, torch's int8 product (``torch._int_mm``) goes between the kernels' quantization and scaling:
the same outputs to the bit, as the integer sums are exact. Without the kernels (the torch backend),
torch's operations quantize and scale (the same up to the last rounding).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.backends.kernels import Kernels, round_up
from nmt.errors import NmtError

FLOAT_MAX = torch.finfo(torch.float32).max
# Multiply-adds from which torch's int8 product on more than one thread (oneDNN's) beat the kernel on
# one: 2 threads on a Zen 4, 64-128 rows of 256 x 256 to 1,024.
THREADED_PRODUCT = 1 << 23


class Int8Weight:
    """An int8 weight (outputs, inputs), a float32 scale per output and an optional bias, with what
    the products need of them: the rows' sums, and where the VNNI kernel runs, the weight in its
    layout (packed once, here) and the sums, scales and bias padded to 16 outputs (its loads)."""

    def __init__(self, values: Tensor, scales: Tensor, bias: Tensor | None, kernels: Kernels | None):
        if values.dtype != torch.int8 or values.dim() != 2 or scales.shape != values.shape[:1] or \
                bias is not None and bias.shape != scales.shape:
            raise ValueError(f"an int8 weight (outputs, inputs), a scale per output and a bias or none, not "
                             f"{values.dtype} {tuple(values.shape)}, {tuple(scales.shape)} and "
                             f"{None if bias is None else tuple(bias.shape)}")
        self.kernels = kernels
        self.values, self.scales = values.contiguous(), scales.float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.row_sums = self.values.sum(dim=1, dtype=torch.int32)
        padding = (0, round_up(len(scales), 16) - len(scales))
        self.padded_sums, self.padded_scales = F.pad(self.row_sums, padding), F.pad(self.scales, padding)
        self.padded_bias = F.pad(self.scales.new_zeros(len(scales)) if bias is None else self.bias, padding)
        self.packed = kernels.pack_int8_weight(self.values) if kernels is not None and kernels.int8_vnni else None

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None, kernels: Kernels | None) -> Int8Weight:
        """A float weight (outputs, inputs) quantized row by row: round(w / scale) with the scale
        max |w| / 127 (1 for a row of zeros); an inf or a NaN is refused."""
        weight = weight.detach().float()
        if not bool(weight.isfinite().all()):
            raise NmtError(f"a weight of {tuple(weight.shape)} holds an inf or a NaN: int8 cannot represent it")
        scales = weight.abs().amax(dim=1) / 127
        scales = torch.where(scales > 0, scales, 1.0)  # a row of zeros (or of subnormals that the division lost)
        values = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(values, scales, bias, kernels)


class Int8Linear(nn.Module):
    def __init__(self, weight: Int8Weight, relu: bool = False):
        super().__init__()
        self.quantized = weight
        self.out_features, self.in_features = weight.values.shape
        self.relu = relu  # a ReLU on its outputs, in the same pass
        self.product = None if weight.packed is None else weight.kernels.int8_product(
            weight.packed, self.in_features, self.out_features, weight.padded_sums, weight.padded_scales,
            weight.padded_bias, relu)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"inputs of {x.shape[-1]} features for a layer of {self.in_features}")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        weight, kernels = self.quantized, self.quantized.kernels
        if self.product is not None and (x.numel() * self.out_features < THREADED_PRODUCT
                                         or torch.get_num_threads() == 1):
            return self.product(x)  # x as it comes (..., inputs): a reshape and a view cost more than its Python
        rows = x.reshape(-1, self.in_features)
        if kernels is not None:
            quantized, row_scales = kernels.int8_quantize_rows(rows)
            out = kernels.int8_scale_outputs(torch._int_mm(quantized, weight.values.t()), row_scales,
                                             weight.padded_scales[:self.out_features],
                                             weight.padded_bias[:self.out_features], self.relu)
        else:
            out = self.torch_product(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def torch_product(self, rows: Tensor) -> Tensor:
        """forward's outputs in torch's operations, without nmt's C kernels: the same quantization and
        integer sums; the last step rounds twice (float64, then float32) where the kernels' fma rounds
        once, which can differ in the last bit."""
        top = rows.abs().amax(dim=1, keepdim=True)
        finite = top.isfinite()
        inverse = torch.where(top > 0, (127 / top).clamp(max=FLOAT_MAX), 0.0)
        quantized = torch.where(finite, torch.round(rows * inverse), 0.0).to(torch.int8)
        row_scales = torch.where(finite, top / 127, float("nan"))
        sums = torch._int_mm(quantized, self.quantized.values.t())
        out = sums.double() * (row_scales * self.quantized.scales).double()
        if self.quantized.bias is not None:
            out += self.quantized.bias.double()
        out = out.float()
        return out.masked_fill_(out < 0, 0.0) if self.relu else out

    def with_relu(self) -> Int8Linear:
        """The same layer (its weights shared) with a ReLU on its outputs, in the same pass."""
        return Int8Linear(self.quantized, relu=True)

    def rows(self, indices: Tensor) -> Int8Linear:
        """The layer of some output rows only (a batch's shortlist candidates), without a bias."""
        weight = self.quantized
        return Int8Linear(Int8Weight(weight.values.index_select(0, indices), weight.scales.index_select(0, indices),
                                     None, weight.kernels))

    def extra_repr(self) -> str:
        relu = ", relu" if self.relu else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{relu}"


def concatenated(layers: list[Int8Linear]) -> Int8Linear:
    """One layer whose outputs are those of ``layers`` side by side, with the same int8 weights and
    scales (a scale per output row; each row of activations quantized once for all, as each layer
    would quantize it alone): the same results in one product."""
    weights = [layer.quantized for layer in layers]
    bias = None if all(w.bias is None for w in weights) else \
        torch.cat([w.scales.new_zeros(len(w.scales)) if w.bias is None else w.bias for w in weights])
    return Int8Linear(Int8Weight(torch.cat([w.values for w in weights]), torch.cat([w.scales for w in weights]),
                                 bias, weights[0].kernels))


def quantize(model: nn.Module, kernels: Kernels | None = None) -> nn.Module:
    """A copy of the model with its linear layers in int8 (Int8Linear: a scale per weight row and per
    row of activations), in nmt's C ``kernels`` where given (the CPU backend's), else in torch's
    operations; in eval mode."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(Int8Weight.of(child.weight, child.bias, kernels)))
    return model.eval()  # inference only: its new layers too
