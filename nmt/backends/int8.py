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
LINEAR_RELU = torch.ops.quantized.linear_relu_dynamic.default
PREPACK = torch.ops.quantized.linear_prepack.default


class Int8Linear(nn.Module):
    def __init__(self, packed: torch.ScriptObject, in_features: int, out_features: int, relu: bool = False):
        super().__init__()
        self.packed = packed  # fbgemm's int8 weight, with the bias
        self.in_features, self.out_features = in_features, out_features
        self.operator = LINEAR_RELU if relu else LINEAR  # with a ReLU on its outputs, in the same pass

    def forward(self, x: Tensor) -> Tensor:
        return self.operator(x, self.packed, True)  # reduce_range, as torch.ao's layer calls it

    def rows(self, indices: Tensor) -> Int8Linear:
        """The layer of some output rows only (a batch's shortlist candidates), without a bias."""
        return Int8Linear(PREPACK(self.weight.index_select(0, indices), None), self.in_features, len(indices))

    @functools.cached_property
    def int_weight(self) -> Tensor:
        """The weight's int8 values (out_features, in_features), contiguous."""
        return self.weight.int_repr().contiguous()

    @functools.cached_property
    def row_sums(self) -> Tensor:
        """Each output row's sum of its int8 weights (int32)."""
        return self.int_weight.sum(dim=1, dtype=torch.int32)

    @functools.cached_property
    def weight(self) -> Tensor:
        """The int8 weight (out_features, in_features), unpacked from fbgemm's layout once (it takes
        longer than packing some of its rows again)."""
        return torch.ops.quantized.linear_unpack(self.packed)[0]

    def extra_repr(self) -> str:
        relu = ", relu" if self.operator is LINEAR_RELU else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{relu}"


def concatenated(layers: list[Int8Linear]) -> Int8Linear | None:
    """One layer whose outputs are those of ``layers`` side by side, with the same int8 weights and
    scales (a scale per output row; the activations, quantized once for all, as each layer would
    quantize them alone): the same results in one product. None where a weight has a scale per row
    or a zero point."""
    unpacked = [torch.ops.quantized.linear_unpack(layer.packed) for layer in layers]
    weights = [weight for weight, _ in unpacked]
    if any(w.qscheme() != torch.per_tensor_affine or w.q_zero_point() for w in weights):
        return None
    scales = torch.cat([torch.full((w.size(0),), w.q_scale(), dtype=torch.float64) for w in weights])
    weight = torch._make_per_channel_quantized_tensor(torch.cat([w.int_repr() for w in weights]), scales,
                                                      torch.zeros(len(scales), dtype=torch.int64), 0)
    bias = None if all(b is None for _, b in unpacked) else \
        torch.cat([torch.zeros(w.size(0)) if b is None else b for w, b in unpacked])
    return Int8Linear(PREPACK(weight, bias), layers[0].in_features, len(scales))


def fuse_layers(model: nn.Module) -> None:
    """Fewer passes per decoding step (docs/performance.md): each int8 decoder layer's self-attention
    gets its q, k and v projections as one layer (``qkv_proj``; the encoder, which runs once per
    batch, keeps its three), and each feed-forward block its first layer with the ReLU in its
    product (``fc1_relu``, the same weights)."""
    for layer in getattr(model, "decoder_layers", []):
        attention = layer.self_attn
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        if all(isinstance(p, Int8Linear) for p in projections):
            attention.qkv_proj = concatenated(projections)
    for block in model.modules():
        first = getattr(block, "fc1", None)
        if hasattr(block, "fc1_relu") and isinstance(first, Int8Linear):
            block.fc1_relu = Int8Linear(first.packed, first.in_features, first.out_features, relu=True)


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
    fuse_layers(model)
    return model
