"""Int8 inference layers (nmt/models/int8.py): torch.ao's dynamic quantization, called straight."""

import warnings

import torch
from torch import nn

from nmt.models.int8 import Int8Linear, quantize


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
