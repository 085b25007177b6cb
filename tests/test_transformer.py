import math

import pytest
import torch

from nmt.backends.cpu_backend import CpuKernelsBackend
from nmt.backends.indexed_cache import IndexedDecoderCache
from nmt.backends.kernel_build import built_kernels
from nmt.backends.torch_backend import TORCH, TorchBackend
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.models.registry import build_model, count_parameters, get_arch, resolve_config
from nmt.models.transformer import Transformer, TransformerConfig, sinusoidal_positions

VOCAB = 50
KERNELS = built_kernels()[0]
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="nmt's CPU kernels could not be built here (no C compiler?)")
# Decoding's two backends: torch's kernel over a cache copied at every reorder, and nmt's C kernels
# over a cache read through each row's history (where they could be built: nmt/backends/cpu_backend.py).
BACKENDS = ["torch", pytest.param("kernels", marks=needs_kernels)]


def backend_named(name: str) -> TorchBackend:
    return TORCH if name == "torch" else CpuKernelsBackend(KERNELS)


def make_model(seed: int = 0, backend: str = "torch", **overrides) -> Transformer:
    torch.manual_seed(seed)
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"dropout": 0.0, **overrides})
    model = build_model(arch.model_name, config, VOCAB, VOCAB, PAD_ID).eval()
    model.backend = backend_named(backend)
    return model


def random_tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (batch, length), generator=g)


def test_forward_shapes():
    model = make_model()
    logits = model(random_tokens(3, 7), random_tokens(3, 5))
    assert logits.shape == (3, 5, VOCAB)


def test_padding_in_source_changes_nothing():
    model = make_model()
    src = random_tokens(1, 6)
    tgt = random_tokens(1, 4)
    padded = torch.cat([src, torch.full((1, 5), PAD_ID)], dim=1)
    torch.testing.assert_close(model(src, tgt), model(padded, tgt), rtol=0, atol=1e-5)


def test_padding_in_target_changes_no_real_position():
    model = make_model()
    src, tgt = random_tokens(1, 6), random_tokens(1, 4)
    padded = torch.cat([tgt, torch.full((1, 3), PAD_ID)], dim=1)
    torch.testing.assert_close(model(src, tgt), model(src, padded)[:, :4], rtol=0, atol=1e-5)


def test_decoder_is_causal():
    model = make_model()
    src, tgt = random_tokens(1, 6), random_tokens(1, 5)
    changed = tgt.clone()
    changed[0, 3:] = 4
    torch.testing.assert_close(model(src, tgt)[:, :3], model(src, changed)[:, :3], rtol=0, atol=1e-5)
    assert not torch.allclose(model(src, tgt)[:, 3:], model(src, changed)[:, 3:])


@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_decoding_equals_full_forward(normalize_before, backend):
    model = make_model(normalize_before=normalize_before, backend=backend)
    src = random_tokens(2, 7)
    src[1, 5:] = PAD_ID
    prev = torch.cat([torch.full((2, 1), BOS_ID), random_tokens(2, 5, seed=2)], dim=1)
    encoder_out = model.encode(src)
    full = model.decode(prev, encoder_out)
    cache = model.new_cache()
    steps = [model.decode(prev[:, t:t + 1], encoder_out, cache) for t in range(prev.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("reserve", [False, True])
def test_a_bf16_cache_decodes_within_bf16s_rounding(reserve):
    """Several positions at once, then one at a time, with the buffers reserved up front or grown:
    the logits within bf16's rounding of the exact ones, and not the same (bf16 was stored)."""
    model = make_model(backend="kernels")
    src = random_tokens(2, 7)
    prev = torch.cat([torch.full((2, 1), BOS_ID), random_tokens(2, 9, seed=2)], dim=1)
    with torch.inference_mode():
        encoder_out = model.encode(src)
        full = model.decode(prev, encoder_out)
        cache = IndexedDecoderCache(len(model.decoder_layers), KERNELS, model.backend.buffers, torch.bfloat16)
        if reserve:
            cache.reserve(prev.size(1), 2)
        steps = [model.decode(prev[:, :3], encoder_out, cache)]
        steps += [model.decode(prev[:, t:t + 1], encoder_out, cache) for t in range(3, prev.size(1))]
    assert {layer.buffer.dtype for layer in cache.layers} == {torch.bfloat16}
    decoded = torch.cat(steps, dim=1)
    torch.testing.assert_close(decoded, full, rtol=0, atol=2e-2)
    assert not torch.allclose(decoded, full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_reorder_follows_beam_indices(backend):
    model = make_model(backend=backend)
    src = random_tokens(2, 5)
    prev = torch.cat([torch.full((2, 1), BOS_ID), random_tokens(2, 3, seed=3)], dim=1)
    encoder_out = model.encode(src)
    cache = model.new_cache()
    with torch.no_grad():  # a cache is for inference
        model.decode(prev[:, :3], encoder_out, cache)
        order = torch.tensor([1, 1, 0])
        cache.reorder(order)
        step = model.decode(prev[order, 3:4], model.reorder_encoder_out(encoder_out, order), cache)
    full = model.decode(prev, encoder_out)[:, 3]
    torch.testing.assert_close(step[:, 0], full[order], rtol=0, atol=1e-5)
    assert cache.length == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_follows_reorders_that_drop_rows_over_many_steps(backend):
    """Rows leave (sentences finish) and positions grow past each buffer's room, with and without
    reorders in between: every step still equals decoding the rows' whole prefixes at once."""
    model = make_model(backend=backend)
    src = random_tokens(6, 5)
    prev = torch.cat([torch.full((6, 1), BOS_ID), random_tokens(6, 39, seed=5)], dim=1)
    encoder_out = model.encode(src)
    rows = torch.arange(6)  # which original row each cached row continues
    cache = model.new_cache()
    with torch.no_grad():
        for t in range(prev.size(1)):
            step = model.decode(prev[rows, t:t + 1], model.reorder_encoder_out(encoder_out, rows), cache)
            full = model.decode(prev[rows, :t + 1], model.reorder_encoder_out(encoder_out, rows))[:, -1]
            torch.testing.assert_close(step[:, 0], full, rtol=0, atol=1e-5)
            if t % 4 == 3:  # appends in between fill the buffers; a row leaves at every third reorder
                order = torch.tensor([0, 0, 2, 1, 4, 3])[:len(rows) - (t % 12 == 11)]
                cache.reorder(order)
                rows = rows[order]
    assert cache.length == 40 and len(rows) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_positions_at_once_after_reorders_read_each_rows_ancestors(backend):
    """Positions given several at a time (a forced prefix, say) after reorders that duplicate, swap
    and drop rows: each row attends to its ancestors' keys and values, as decoding its whole prefix does."""
    model = make_model(backend=backend)
    src = random_tokens(3, 5)
    prev = torch.cat([torch.full((3, 1), BOS_ID), random_tokens(3, 9, seed=7)], dim=1)
    encoder_out = model.encode(src)
    cache = model.new_cache()
    rows = torch.arange(3)
    with torch.no_grad():
        model.decode(prev[:, :3], encoder_out, cache)
        for order, start, stop in ((torch.tensor([2, 0, 0]), 3, 4), (torch.tensor([1, 2, 0]), 4, 7),
                                   (torch.tensor([2, 1]), 7, 10)):
            cache.reorder(order)
            rows = rows[order]
            step = model.decode(prev[rows, start:stop], model.reorder_encoder_out(encoder_out, rows), cache)
            full = model.decode(prev[rows, :stop], model.reorder_encoder_out(encoder_out, rows))[:, start:]
            torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
    assert cache.length == 10 and rows.tolist() == [2, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reserved_cache_never_replaces_its_buffers(backend):
    """Search reserves room for its longest output on CPU: each layer's buffer and the spare are made
    once, however the rows change, and decoding is the same as with buffers that grow."""
    model = make_model(backend=backend)
    src = random_tokens(3, 5)
    prev = torch.cat([torch.full((6, 1), BOS_ID), random_tokens(6, 29, seed=6)], dim=1)
    encoder_out = model.reorder_encoder_out(model.encode(src), torch.tensor([0, 0, 1, 1, 2, 2]))
    outputs, storages = [], set()
    for reserve in (True, False):
        cache = model.new_cache()
        if reserve:
            cache.reserve(prev.size(1), 6)
        with torch.no_grad():
            steps, rows = [], torch.arange(6)
            for t in range(prev.size(1)):
                steps.append(model.decode(prev[rows, t:t + 1], model.reorder_encoder_out(encoder_out, rows), cache))
                order = torch.tensor([1, 0, 3, 2, 4, 5])[:6 - t // 10]  # rows leave at steps 10 and 20
                cache.reorder(order)
                rows = rows[order]
                if reserve:
                    storages |= {layer.buffer.data_ptr() for layer in cache.layers}
                    storages |= {cache.spare.data_ptr()} if backend == "torch" else set()
        outputs.append(torch.cat([step[:4] for step in steps], dim=1))
    assert len(storages) == len(model.decoder_layers) + (backend == "torch")
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_grouped_per_sentence_read_their_own_source(backend):
    """Beam search keeps one encoder row per sentence for its k beams (k consecutive decoder rows):
    that must equal decoding with each sentence's encoder output copied k times."""
    model = make_model(backend=backend)
    src = random_tokens(2, 6)
    src[0, 4:] = PAD_ID
    prev = torch.cat([torch.full((6, 1), BOS_ID), random_tokens(6, 3, seed=4)], dim=1)  # 3 rows per sentence
    encoder_out = model.encode(src)
    copied = model.reorder_encoder_out(encoder_out, torch.tensor([0, 0, 0, 1, 1, 1]))
    with torch.no_grad():
        grouped, cache = [], model.new_cache()
        for t in range(prev.size(1)):
            grouped.append(model.decode(prev[:, t:t + 1], encoder_out, cache))
    torch.testing.assert_close(torch.cat(grouped, dim=1), model.decode(prev, copied), rtol=0, atol=1e-5)
    torch.testing.assert_close(model.decode(prev, encoder_out), model.decode(prev, copied), rtol=0, atol=1e-5)
    other = model.decode(prev, model.reorder_encoder_out(encoder_out, torch.tensor([1, 1, 1, 0, 0, 0])))
    assert not torch.allclose(other, model.decode(prev, copied), atol=1e-3)  # the sentences do differ
    with pytest.raises(ValueError, match="same number of rows"):
        model.decode(prev[:5], encoder_out)


def test_three_way_tying_is_one_tensor():
    model = make_model()
    assert model.src_embed.weight is model.tgt_embed.weight
    assert model.output_weight() is model.tgt_embed.weight


def test_two_way_and_untied():
    decoder_tied = make_model(share_embeddings="decoder")
    assert decoder_tied.src_embed.weight is not decoder_tied.tgt_embed.weight
    assert decoder_tied.output_weight() is decoder_tied.tgt_embed.weight
    untied = make_model(share_embeddings="none")
    assert untied.output_weight() is not untied.tgt_embed.weight
    d = untied.config.d_model
    assert count_parameters(untied) - count_parameters(make_model()) == 2 * VOCAB * d


@pytest.mark.parametrize("share", ["all", "none"])
def test_separate_output_layer_keeps_the_logits_and_the_saved_state(share):
    model = make_model(share_embeddings=share)
    source, target = random_tokens(2, 6), random_tokens(2, 4, seed=2)
    keys, before = set(model.state_dict()), model(source, target)
    model.separate_output_layer()
    assert isinstance(model.output_layer, torch.nn.Linear)
    assert torch.equal(model.output_layer.weight, model.output_weight())
    torch.testing.assert_close(model(source, target), before, rtol=0, atol=1e-6)
    assert set(model.state_dict()) - keys == {"output_layer.weight"}  # added, nothing renamed


def test_joint_tying_needs_equal_vocabularies():
    from nmt.errors import NmtError

    with pytest.raises(NmtError, match="joint vocabulary"):
        Transformer(TransformerConfig(), 100, 120, PAD_ID)


def test_embeddings_are_scaled_and_pad_row_is_zero():
    model = make_model().eval()  # no embedding dropout
    assert model.embed_scale == math.sqrt(model.config.d_model)
    assert torch.count_nonzero(model.tgt_embed.weight[PAD_ID]) == 0
    tokens = torch.tensor([[5, 9, PAD_ID]])
    expected = model.tgt_embed.weight[tokens[0]] * math.sqrt(model.config.d_model) + model.positions[:3]
    torch.testing.assert_close(model._embed(model.tgt_embed, tokens)[0], expected)  # the scale is applied


def test_sinusoidal_positions_match_the_paper():
    table = sinusoidal_positions(10, 8)
    pos, i = 7, 2
    assert table[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 8)), abs=1e-6)
    assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 8)), abs=1e-6)
    model = make_model()
    assert torch.equal(model.positions, sinusoidal_positions(model.config.max_positions, model.config.d_model))
    assert "positions" not in model.state_dict()  # computed, not saved: old checkpoints load as before


def test_longer_than_max_positions_is_a_clear_error():
    from nmt.errors import NmtError

    model = make_model(max_positions=8)
    with pytest.raises(NmtError, match="9 tokens is over the model's max_positions 8"):
        model(random_tokens(1, 9), random_tokens(1, 3))


@pytest.mark.slow
@pytest.mark.parametrize("arch,paper_millions", [("transformer_base", 65), ("transformer_big", 213)])
def test_parameter_counts_match_table_3(arch, paper_millions):
    # Table 3 reports 65M / 213M for a 37k joint vocabulary. Our count of the paper's exact
    # layout is 63.1M / 214.2M; the paper's figures are rounded and its base count is ~3%
    # above the layout's arithmetic (as fairseq's is), so allow 4%.
    spec = get_arch(arch)
    model = build_model(spec.model_name, spec.config, 37000, 37000, PAD_ID)
    assert count_parameters(model) / 1e6 == pytest.approx(paper_millions, rel=0.04)


def test_paper_hyper_parameters():
    base, big = get_arch("transformer_base").config, get_arch("transformer_big").config
    assert (base.encoder_layers, base.decoder_layers, base.d_model, base.ffn_dim, base.heads, base.dropout) == \
        (6, 6, 512, 2048, 8, 0.1)
    assert (big.d_model, big.ffn_dim, big.heads, big.dropout) == (1024, 4096, 16, 0.3)
    assert get_arch("transformer_big_en_fr").config.dropout == 0.1
    assert not base.normalize_before and base.share_embeddings == "all"


def test_bf16_autocast_runs_on_cpu():
    from nmt.device import autocast

    model = make_model()
    with autocast(torch.device("cpu"), "bf16"):
        logits = model(random_tokens(2, 5), random_tokens(2, 4))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_decoding_on_cpu_caches_and_attends_in_fp32(backend):
    """torch's CPU attention kernel is slow in bf16 for one query: the decoding steps attend in fp32,
    while the projections stay bf16; torch's cache keeps keys and values in fp32 (nmt's kernels, given
    a cache made under bf16 autocast, keep bf16: see test_cpu_kernels.py)."""
    from nmt.device import autocast

    model = make_model(backend=backend)
    src = random_tokens(2, 7)
    prev = torch.cat([torch.full((2, 1), BOS_ID), random_tokens(2, 4, seed=2)], dim=1)
    cache = model.new_cache()  # outside autocast: float32 whichever backend
    with torch.inference_mode(), autocast(torch.device("cpu"), "bf16"):
        encoder_out = model.encode(src)
        steps = torch.cat([model.decode(prev[:, t:t + 1], encoder_out, cache) for t in range(prev.size(1))], dim=1)
    assert all(k.dtype == v.dtype == torch.float32 for k, v in encoder_out.memory)
    assert all(layer.buffer.dtype == torch.float32 for layer in cache.layers)
    assert steps.dtype == torch.bfloat16  # the output projection still computes in bf16
    with torch.inference_mode():
        exact = model.decode(prev, model.encode(src))
    torch.testing.assert_close(steps.float(), exact, rtol=0, atol=0.1)


def test_decoding_on_cpu_widens_the_cross_attention_keys_and_values_to_fp32_once():
    """bf16 decoding on CPU attends in fp32: the encoder's keys and values for decoding are widened at
    encode (not at every step), where the encoder itself (as training runs it) keeps them as computed."""
    model = make_model().eval()
    src = random_tokens(3, 5)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        computed = model.encode_sentences(src)[1]
        decoding = model.encode(src).memory
    assert all(t.dtype == torch.bfloat16 for kv in computed for t in kv)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for kv in decoding for t in kv)


def test_decoding_on_cpu_encodes_a_few_sentences_at_a_time_with_the_same_result(monkeypatch):
    """The chunks' cross-attention keys and values are the batch's (fp32), each sentence
    with its padding; training's forward pass and attention maps still see the batch at once."""
    from nmt.backends import torch_backend
    from nmt.models.attention_maps import attention_maps

    model = make_model()
    src = random_tokens(5, 7)
    src[2, 4:] = PAD_ID
    with torch.inference_mode():
        whole = model.encode(src)
        monkeypatch.setattr(torch_backend, "ENCODE_CHUNK", 14)  # two sentences a chunk
        encoded = []
        monkeypatch.setattr(model, "encode_sentences", lambda chunk, original=model.encode_sentences:
                            encoded.append(len(chunk)) or original(chunk))
        chunked = model.encode(src)
    assert encoded == [2, 2, 1]
    assert torch.equal(chunked.padding_mask, whole.padding_mask)
    for (keys, values), (whole_keys, whole_values) in zip(chunked.memory, whole.memory):
        torch.testing.assert_close(keys, whole_keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(values, whole_values, rtol=0, atol=1e-6)
    maps = attention_maps(model, src, torch.full((5, 1), BOS_ID))
    assert encoded == [2, 2, 1, 5] and len(maps.encoder) == len(model.encoder_layers)


def test_bf16_training_on_cpu_attends_in_fp32(monkeypatch):
    """The bf16 CPU attention kernel's backward is 5x slower than fp32's: attention computes in fp32
    while the projections around it stay bf16, and gradients flow through the casts."""
    import torch.nn.functional as F

    from nmt.device import autocast

    seen = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = make_model().train()
    with autocast(torch.device("cpu"), "bf16"):
        logits = model(random_tokens(2, 5), random_tokens(2, 4))
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert seen and all(dtypes == (torch.float32,) * 3 for dtypes in seen)
    assert model.encoder_layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_drops_p_and_rescales_the_rest(dtype):
    from nmt.models.transformer import Dropout

    torch.manual_seed(0)
    dropout = Dropout(0.3)
    x = torch.ones(400, 500, dtype=dtype, requires_grad=True)
    y = dropout(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.3) < 0.005
    kept = y[y != 0].float()
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.7), rtol=4e-3, atol=0)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert torch.equal(x.grad != 0, y != 0)  # the gradient flows through the kept positions only
    assert torch.equal(dropout.eval()(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)


@needs_kernels
def test_the_next_batch_reuses_the_cache_buffers_and_live_caches_never_share():
    """A collected cache gives its buffers back (their pages are already faulted in) and the backend's
    pool keeps one cache's worth; two caches in use at once (threads decoding) each have their own."""
    import gc

    model = make_model(backend="kernels")
    pool = model.backend.buffers
    src = random_tokens(2, 5)
    prev = torch.cat([torch.full((2, 1), BOS_ID), random_tokens(2, 6, seed=7)], dim=1)

    def decode(cache):
        with torch.no_grad():
            encoder_out = model.encode(src)
            cache.reserve(prev.size(1), 2)
            return torch.cat([model.decode(prev[:, t:t + 1], encoder_out, cache) for t in range(prev.size(1))], dim=1)

    first = model.new_cache()
    expected = decode(first)
    used = {layer.buffer.untyped_storage().data_ptr() for layer in first.layers}
    second = model.new_cache()
    decode(second)
    assert not used & {layer.buffer.untyped_storage().data_ptr() for layer in second.layers}  # both alive
    del first, second
    gc.collect()
    returned = {buffer.untyped_storage().data_ptr() for buffers in pool.returned for buffer in buffers}
    assert len(returned) == 2 * len(model.decoder_layers)  # both caches gave theirs back when collected
    third = model.new_cache()
    torch.testing.assert_close(decode(third), expected, rtol=0, atol=0)  # what the buffers held before is never read
    assert {layer.buffer.untyped_storage().data_ptr() for layer in third.layers} <= returned  # no new ones
    assert pool.free == []  # the pool kept one cache's worth, which the third took


@needs_kernels
def test_decoding_on_cpu_leaves_the_encoder_output_in_place_as_sentences_leave():
    """With nmt's C kernels, reordering renumbers rows (no copy of the keys and values) and decodes as
    the copies do; torch's attention reads the same rows."""
    model = make_model(5, backend="kernels")
    src = torch.tensor([[5, 6, 7, EOS_ID], [8, 9, EOS_ID, PAD_ID], [10, EOS_ID, PAD_ID, PAD_ID]])
    with torch.inference_mode():
        encoder_out = model.encode(src)
        kept = model.reorder_encoder_out(model.reorder_encoder_out(encoder_out, torch.tensor([2, 0, 1])),
                                         torch.tensor([0, 2]))  # sentences 2 and 1 remain
        assert kept.sentences() == 2 and all(layer.keys is keys and layer.rows.tolist() == [2, 1]
                                             for layer, (keys, _) in zip(kept.memory, encoder_out.memory))
        copied = encoder_out._replace(padding_mask=encoder_out.padding_mask[[2, 1]],
                                      memory=tuple((k[[2, 1]], v[[2, 1]]) for k, v in encoder_out.memory))
        prev = torch.tensor([[BOS_ID]] * 2)
        expected = model.decode(prev, copied, model.new_cache())
        assert torch.equal(model.decode(prev, kept, model.new_cache()), expected)
        prev = torch.tensor([[BOS_ID, 5]] * 2)  # without a cache: the whole prefix at once
        torch.testing.assert_close(model.decode(prev, kept), model.decode(prev, copied))
        query = torch.randn(2, 4, 3, 16)  # without a mask the kernel is not called: torch's attention on the rows
        torch.testing.assert_close(model.backend.attention(query, kept.memory[0]),
                                   TORCH.attention(query, copied.memory[0]))
