"""Int8 inference layers (nmt/backends/int8.py): torch.ao's dynamic quantization, called straight."""

import warnings

import torch
from torch import nn

from nmt.backends.int8 import Int8Linear, quantize
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.models.transformer import Transformer, transformer_tiny


def test_the_same_products_as_torch_ao_s_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    ours = quantize(model)
    assert [type(m) for m in ours] == [Int8Linear, nn.ReLU, Int8Linear]
    x = torch.randn(5, 3, 16)
    assert torch.equal(ours(x), reference(x))
    assert not torch.equal(ours(x), model(x))  # int8, not the float layers


def test_a_layer_of_some_rows_multiplies_by_those_rows():
    torch.manual_seed(1)
    layer = quantize(nn.Sequential(nn.Linear(16, 40, bias=False)))[0]
    rows = torch.tensor([3, 0, 39, 17])
    x = torch.randn(6, 16)
    torch.testing.assert_close(layer.rows(rows)(x), layer(x)[:, rows], rtol=0, atol=1e-6)


def test_fused_projections_give_each_layer_s_own_results():
    """Weights of different ranges keep their own scales in the fused layer: the same products, bit for bit."""
    torch.manual_seed(2)
    model = Transformer(transformer_tiny(), 20, 20, PAD_ID).eval()
    with torch.no_grad():
        model.decoder_layers[1].self_attn.k_proj.weight.mul_(5.0)
    model = quantize(model)
    assert model.encoder_layers[0].self_attn.qkv_proj is None  # the encoder runs once per batch: not fused
    attention = model.decoder_layers[1].self_attn
    assert isinstance(attention.qkv_proj, Int8Linear) and attention.qkv_proj.out_features == 3 * 64
    x = torch.randn(3, 1, 64)
    q, k, v = attention.project_qkv(x)
    assert torch.equal(q, attention.split_heads(attention.q_proj(x)))
    assert torch.equal(k, attention.split_heads(attention.k_proj(x)))
    assert torch.equal(v, attention.split_heads(attention.v_proj(x)))


def test_int8_decoding_steps_project_queries_keys_and_values_at_once():
    torch.manual_seed(3)
    model = quantize(Transformer(transformer_tiny(), 20, 20, PAD_ID).eval())
    source = torch.tensor([[5, 6, 7, EOS_ID]])
    with torch.inference_mode():
        encoder_out, cache = model.encode(source), model.new_cache()
        fused = [(layer.self_attn.qkv_proj, layer.ffn.fc1_relu) for layer in model.decoder_layers]
        for layer in model.decoder_layers:  # the separate layers' results
            layer.self_attn.qkv_proj = layer.ffn.fc1_relu = None
        expected = model.decode(torch.tensor([[BOS_ID]]), encoder_out, cache)
        for layer, (qkv, fc1_relu) in zip(model.decoder_layers, fused):  # the fused layers, the separate not called
            layer.self_attn.qkv_proj, layer.ffn.fc1_relu = qkv, fc1_relu
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.forward = not_called
        assert torch.equal(model.decode(torch.tensor([[BOS_ID]]), encoder_out, model.new_cache()), expected)


def not_called(x: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a separate projection was called")


def test_int8_feed_forward_layers_apply_the_relu_in_their_first_product():
    torch.manual_seed(4)
    model = quantize(Transformer(transformer_tiny(), 20, 20, PAD_ID).eval())
    block = model.decoder_layers[0].ffn
    x = torch.randn(5, 1, 64)
    expected = block.fc2(torch.relu(block.fc1(x)))
    block.fc1.forward = not_called
    assert isinstance(block.fc1_relu, Int8Linear) and torch.equal(block(x), expected)
