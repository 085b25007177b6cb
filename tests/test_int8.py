"""Int8 inference layers (nmt/backends/int8.py): int8 weights, each row of activations quantized on
its own, so that a sentence's outputs and translation never depend on its batch (#40)."""

import warnings

import pytest
import torch
from torch import nn

from nmt import Translator
from nmt.backends import int8 as int8_module
from nmt.backends.int8 import Int8Linear, quantize
from nmt.backends.kernel_build import built_kernels
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.errors import NmtError
from nmt.generation.fused_layers import FusedSelfAttention, fuse_int8_layers
from nmt.models.attention import MultiHeadAttention
from nmt.models.transformer import Transformer, transformer_tiny

KERNELS = built_kernels()[0]
# The layers' paths: nmt's C kernels (VNNI's int8_linear where built with it), and torch's operations.
PATHS = [pytest.param(KERNELS, id="kernels", marks=pytest.mark.skipif(KERNELS is None, reason="no kernels here")),
         pytest.param(None, id="torch")]


def rows_of_every_magnitude(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows from 1e-3 to 1e3 in size, one of zeros: a batch's sentences are not alike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows)[torch.randperm(rows, generator=g), None]
    x[rows // 2] = 0
    return x


def close(a: torch.Tensor, b: torch.Tensor, relative: float = 0.0, absolute: float = 0.0) -> bool:
    """Within the tolerances, NaN where the other is NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and bool(((a - b).abs() <= absolute + relative * b.abs())[~nan].all())


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("inputs,outputs", [(64, 192), (100, 70), (256, 1030)])
def test_a_row_s_products_are_the_same_alone_and_in_any_batch(inputs, outputs, kernels):
    """To the bit, whatever the rows beside it (fbgemm's dynamic layer gave the whole batch one scale)."""
    torch.manual_seed(inputs)
    layer = quantize(nn.Sequential(nn.Linear(inputs, outputs)), kernels)[0]
    x = rows_of_every_magnitude(23, inputs, seed=outputs)
    whole = layer(x)
    for i in range(len(x)):
        assert torch.equal(layer(x[i:i + 1]), whole[i:i + 1]), i
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(layer(x[order]), whole[order])
    assert torch.equal(layer(x[3:9].view(2, 3, inputs)), whole[3:9].view(2, 3, outputs))
    assert torch.equal(layer(torch.cat([x[:7], 1e4 * x[:7]]))[:7], whole[:7])  # beside larger rows


@pytest.mark.parametrize("kernels", PATHS)
def test_each_row_is_quantized_to_8_bits_with_a_scale_of_its_own(kernels):
    """round(x * 127 / max |x|) times the int8 weight, scaled back: closer to the float layer than
    fbgemm's one 7-bit scale per batch where the rows differ in size; a row with an inf or a NaN
    gives NaN, the others what they give alone."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(100, 70))
    layer = quantize(model, kernels)[0]
    x = rows_of_every_magnitude(9, 100, seed=8)
    weight = layer.quantized
    top = x.abs().amax(dim=1, keepdim=True)
    q = torch.round(x * torch.where(top > 0, 127 / top, 0))
    exact = (q.double() @ weight.values.double().t()) * (top / 127 * weight.scales).double() + weight.bias.double()
    out = layer(x)
    assert close(out, exact.float(), relative=1e-6, absolute=1e-7)
    assert torch.equal(out[4], weight.bias)  # the row of zeros
    assert torch.equal(layer.with_relu()(x), torch.relu(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fbgemm = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)[0]
    with torch.no_grad():
        expected = model(x)
        ours, theirs = ((y - expected).abs() / expected.abs().amax(dim=1, keepdim=True) for y in (out, fbgemm(x)))
    assert ours.mean() < theirs.mean() / 10  # relative to each row's size
    x[2, 5], x[6, 0] = float("nan"), float("inf")
    kept = [0, 1, 3, 4, 5, 7, 8]
    assert layer(x)[[2, 6]].isnan().all() and torch.equal(layer(x)[kept], out[kept])


@pytest.mark.parametrize("kernels", PATHS)
def test_each_weight_row_is_quantized_with_a_scale_of_its_own(kernels):
    """round(w * 127 / max |w|) per output row: a row 1,000 times smaller than its neighbours keeps
    its 8 bits (one scale for the whole weight, torch.ao's, rounds it to a few levels or to zero)."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(64, 6, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(torch.tensor([1.0, 1e-3, 1.0, 1e-3, 10.0, 0.0])[:, None])
    weight = quantize(model, kernels)[0].quantized
    top = model[0].weight.abs().amax(dim=1)
    assert torch.equal(weight.scales, torch.where(top > 0, top / 127, 1.0))
    assert torch.equal(weight.values.abs().amax(dim=1), torch.tensor([127, 127, 127, 127, 127, 0], dtype=torch.int8))
    assert close(weight.values.float() * weight.scales[:, None], model[0].weight.detach(),
                 absolute=0.0, relative=0.0) or \
        bool(((weight.values.float() * weight.scales[:, None] - model[0].weight).abs()
              <= weight.scales[:, None] / 2 + 1e-12).all())  # each within half its own step
    x = torch.randn(5, 64)
    with torch.no_grad():
        expected = model(x)
    out = quantize(model, kernels)[0](x)
    small = [1, 3]
    assert close(out[:, small], expected[:, small], relative=0.05, absolute=1e-5)


def test_a_weight_with_an_inf_or_a_nan_is_refused():
    """int8 has no value for it, and a NaN's row would otherwise turn into finite outputs."""
    model = nn.Sequential(nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight[2, 3] = float("nan")
    with pytest.raises(NmtError, match=r"a weight of \(4, 8\) holds an inf or a NaN"):
        quantize(model)


@pytest.mark.skipif(KERNELS is None, reason="nmt's CPU kernels could not be built here")
@pytest.mark.parametrize("relu", [False, True])
def test_the_c_kernel_torch_s_int8_product_and_torch_s_operations_give_the_same_outputs(relu, monkeypatch):
    """VNNI's kernel where it is built; torch._int_mm between the C kernels' quantization and
    scaling elsewhere (the same bits); torch's operations without the kernels (the same but for
    the last rounding)."""
    torch.manual_seed(9)
    layer = quantize(nn.Sequential(nn.Linear(250, 1030)), KERNELS)[0]
    layer = layer.with_relu() if relu else layer
    x = rows_of_every_magnitude(13, 250, seed=10)
    x[3, 7] = float("nan")
    out = layer(x)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()
    monkeypatch.setattr(layer.quantized, "packed", None)
    assert close(layer(x), out)  # torch._int_mm's
    monkeypatch.setattr(layer.quantized, "kernels", None)
    assert close(layer(x), out, relative=1e-6)  # torch's operations


@pytest.mark.skipif(KERNELS is None or not KERNELS.int8_vnni, reason="needs the kernels built with AVX512-VNNI")
def test_large_products_on_two_threads_give_what_one_thread_gives():
    """On more than one thread a large product goes to torch's int8 product (its threads): the same bits."""
    torch.manual_seed(13)
    layer = quantize(nn.Sequential(nn.Linear(256, 1030)), KERNELS)[0]
    x = rows_of_every_magnitude(70, 256, seed=14)
    assert 70 * 256 * 1030 >= int8_module.THREADED_PRODUCT
    one = layer(x)
    torch.set_num_threads(2)  # put back by conftest's threads_as_they_were
    assert torch.equal(layer(x), one)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(70)]), one)


def test_a_layer_of_some_rows_multiplies_by_those_rows():
    torch.manual_seed(1)
    layer = quantize(nn.Sequential(nn.Linear(16, 40, bias=False)))[0]
    rows = torch.tensor([3, 0, 39, 17])
    x = torch.randn(6, 16)
    assert torch.equal(layer.rows(rows)(x), layer(x)[:, rows])


def fused(model: nn.Module) -> nn.Module:
    return fuse_int8_layers(quantize(model))


def test_fused_projections_give_each_layer_s_own_results():
    """Weights of different ranges keep their own scales in the fused layer: the same products, bit for bit."""
    torch.manual_seed(2)
    model = Transformer(transformer_tiny(), 20, 20, PAD_ID).eval()
    with torch.no_grad():
        model.decoder_layers[1].self_attn.k_proj.weight.mul_(5.0)
    model = fused(model)
    assert type(model.encoder_layers[0].self_attn) is MultiHeadAttention  # the encoder runs once per batch: not fused
    attention = model.decoder_layers[1].self_attn
    assert isinstance(attention, FusedSelfAttention) and attention.qkv_proj.out_features == 3 * 64
    x = torch.randn(3, 1, 64)
    q, k, v = attention.project_qkv(x)
    assert torch.equal(q, attention.split_heads(attention.q_proj(x)))
    assert torch.equal(k, attention.split_heads(attention.k_proj(x)))
    assert torch.equal(v, attention.split_heads(attention.v_proj(x)))


def test_int8_decoding_steps_project_queries_keys_and_values_at_once():
    """The fused model decodes as the unfused one, to the bit, without calling the separate projections."""
    torch.manual_seed(3)
    model = quantize(Transformer(transformer_tiny(), 20, 20, PAD_ID).eval())
    source = torch.tensor([[5, 6, 7, EOS_ID]])
    with torch.inference_mode():
        encoder_out = model.encode(source)
        expected = model.decode(torch.tensor([[BOS_ID]]), encoder_out, model.new_cache())
        model = fuse_int8_layers(model)
        for layer in model.decoder_layers:
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                module.forward = not_called
            assert isinstance(layer.ffn.activation, nn.Identity) and layer.ffn.fc1.relu
        assert torch.equal(model.decode(torch.tensor([[BOS_ID]]), encoder_out, model.new_cache()), expected)


def not_called(x: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a separate projection was called")


def test_int8_feed_forward_layers_apply_the_relu_in_their_first_product():
    torch.manual_seed(4)
    model = quantize(Transformer(transformer_tiny(), 20, 20, PAD_ID).eval())
    block = model.decoder_layers[0].ffn
    x = torch.randn(5, 1, 64)
    expected = block.fc2(torch.relu(block.fc1(x)))
    fuse_int8_layers(model)
    assert torch.equal(block(x), expected)
    assert isinstance(block.fc1, Int8Linear) and block.fc1.relu and isinstance(block.activation, nn.Identity)


def test_fused_modules_keep_the_model_s_mode():
    """An eval model stays in eval mode (no attention dropout) once its layers are swapped."""
    model = fused(Transformer(transformer_tiny(), 20, 20, PAD_ID).eval())
    assert isinstance(model.decoder_layers[0].self_attn, FusedSelfAttention)
    assert not any(module.training for module in model.modules())


def test_fusing_leaves_a_model_that_is_not_int8_as_it_is():
    model = Transformer(transformer_tiny(), 20, 20, PAD_ID).eval()
    before = [type(module) for module in model.modules()]
    assert [type(module) for module in fuse_int8_layers(model).modules()] == before


def scored(translator: Translator, sentences: list[str], **options) -> list[list[tuple]]:
    return [[(h.pieces, h.score, h.token_scores) for h in hyps]
            for hyps in translator.hypotheses(sentences, beam=3, nbest=2, max_len_a=0, max_len_b=8, **options)]


SENTENCES = ["five", "My room number is eighty-two and his is seventy-seven thousand three hundred and forty-one",
             "the number four", "x"]


def test_an_int8_translation_is_the_same_alone_in_any_batch_and_through_translator(untrained_checkpoint):
    """Each sentence's hypotheses, scores to the bit, as it decodes alone and in batches of other
    sentences, short and long, through the Python API (the path `nmt serve` translates by). The
    untrained model's close scores make any difference show."""
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", quantize="int8")
    assert any(isinstance(m, Int8Linear) for m in translator.model.modules())
    alone = [scored(translator, [sentence])[0] for sentence in SENTENCES]
    assert scored(translator, SENTENCES) == alone
    assert scored(translator, SENTENCES[::-1], batch_size=3) == alone[::-1]
    longer = [SENTENCES[1] + " and " + SENTENCES[1]] * 3
    assert scored(translator, longer + SENTENCES + SENTENCES[:2])[3:-2] == alone
