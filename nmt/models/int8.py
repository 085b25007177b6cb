"""Linear layers in int8 for inference on CPU: torch's dynamic quantization, called straight.

``quantize(model)`` turns every ``nn.Linear`` into torch.ao's dynamic int8 layer (int8 weights, each
batch's activations quantized on the fly, fbgemm's kernels) and then each of those into an
:class:`Int8Linear` that calls the same operator with the same arguments: torch.ao's module checks
its version and weight type and goes through the Python operator registry on every call, about 4 us
of the 10-20 us that a decoding step's small products take.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor, nn

LINEAR = torch.ops.quantized.linear_dynamic.default
PREPACK = torch.ops.quantized.linear_prepack.default


class Int8Linear(nn.Module):
    def __init__(self, packed: torch.ScriptObject, in_features: int, out_features: int):
        super().__init__()
        self.packed = packed  # fbgemm's int8 weight, with the bias
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: Tensor) -> Tensor:
        return LINEAR(x, self.packed, True)  # reduce_range, as torch.ao's layer calls it

    def rows(self, indices: Tensor) -> Int8Linear:
        """The layer of some output rows only (a batch's shortlist candidates), without a bias."""
        return Int8Linear(PREPACK(self.weight.index_select(0, indices), None), self.in_features, len(indices))

    @functools.cached_property
    def weight(self) -> Tensor:
        """The int8 weight (out_features, in_features), unpacked from fbgemm's layout once (it takes
        longer than packing some of its rows again)."""
        return torch.ops.quantized.linear_unpack(self.packed)[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize(model: nn.Module) -> nn.Module:
    """A copy of the model with its linear layers in int8 (as torch.ao's quantize_dynamic makes it)."""
    with warnings.catch_warnings():  # torch.ao's eager quantization warns it will move to torchao
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, torch.ao.nn.quantized.dynamic.Linear):
                setattr(parent, name, Int8Linear(child._packed_params._packed_params, child.in_features,
                                                 child.out_features))
    return model
