"""Fewer passes per int8 decoding step: layers fused as torch.ao's ``fuse_modules`` fuses them, by
swapping modules of a model prepared for decoding (the model's own code stays as it trains).

- Each decoder layer's self-attention becomes a :class:`FusedSelfAttention`, its q, k and v
  projections one product. The encoder, which runs once per batch, keeps its three.
- Each feed-forward block's first layer takes the ReLU into its product, and its ReLU becomes an
  identity.

Both use the same int8 weights, and give the same results to the bit (tests/test_int8.py);
benchmarks/notes/amd-epyc-zen5.md has what they gain.
"""

from __future__ import annotations

from torch import Tensor, nn

from nmt.backends.int8 import Int8Linear, concatenated
from nmt.models.attention import MultiHeadAttention
from nmt.models.transformer import FeedForward


class FusedSelfAttention(MultiHeadAttention):
    """A self-attention whose queries, keys and values come from one product (``qkv_proj``); it holds
    the attention's own layers under the same names and is otherwise that attention."""

    def __init__(self, attention: MultiHeadAttention, qkv_proj: nn.Module):
        nn.Module.__init__(self)  # not MultiHeadAttention's, which would make new projections
        self.__dict__.update({name: value for name, value in vars(attention).items() if not name.startswith("_")})
        for name, layer in attention.named_children():  # its settings (heads, dropout) above, its layers here
            self.add_module(name, layer)
        self.qkv_proj = qkv_proj
        self.train(attention.training)  # the new product in the attention's mode too

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)


def fuse_int8_layers(model: nn.Module) -> nn.Module:
    """``model`` (int8.quantize's) with its decoder's self-attention and its feed-forward blocks fused."""
    for layer in getattr(model, "decoder_layers", []):
        attention = layer.self_attn
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        if all(isinstance(p, Int8Linear) for p in projections):
            layer.self_attn = FusedSelfAttention(attention, concatenated(projections))
    for block in model.modules():
        if isinstance(block, FeedForward) and isinstance(block.fc1, Int8Linear) and \
                isinstance(block.activation, nn.ReLU):
            block.fc1, block.activation = block.fc1.with_relu(), nn.Identity()
            block.train(block.training)  # the new modules in the block's mode
    return model
