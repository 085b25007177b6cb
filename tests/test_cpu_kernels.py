"""nmt's C kernels for decoding on CPU (nmt/backends/kernels.py, kernel_build.py, cpu_backend.py) against
torch's operations (nmt/backends/torch_backend.py)."""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nmt.backends import kernel_build
from nmt.backends.cpu_backend import CpuKernelsBackend
from nmt.backends.indexed_cache import IndexedDecoderCache
from nmt.backends.kernels import SOURCE, Kernels, prototypes
from nmt.backends.kv_cache import DecoderCache
from nmt.backends.torch_backend import TORCH
from nmt.generation.inference import choose_backend
from nmt.log import logger
from nmt.models.registry import build_model, get_arch, resolve_config

KERNELS = kernel_build.built_kernels()[0]
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="nmt's CPU kernels could not be built here (no C compiler?)")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_with_a_c_compiler_the_kernels_build():
    """Else every test that needs them would be skipped, and a broken kernel source would pass."""
    assert KERNELS is not None, kernel_build.built_kernels()[1]


def test_every_exported_kernel_is_typed_from_its_c_prototype():
    """The argument types come from kernels.c's declarations: every exported function is found, with
    as many parameters as its declaration has, pointers typed by their C type."""
    found = prototypes(SOURCE.read_text())
    assert set(found) == {"append_position", "append_position_bf16", "self_attention", "self_attention_bf16",
                          "grouped_attention", "log_softmax_rows", "select_top", "project_columns_int8",
                          "attention_avx512", "int8_vnni", "pack_int8_weight", "int8_linear",
                          "int8_quantize_rows", "int8_scale_outputs"}
    grouped = found["grouped_attention"]
    assert [p.name for p in grouped.parameters] == ["keys", "values", "allowed", "rows", "sentences", "group", "heads",
                                                    "length", "head_dim", "query", "out", "scores"]
    assert grouped.parameters[2].dtypes == (torch.bool, torch.uint8) and grouped.parameters[3].nullable
    assert not grouped.parameters[0].nullable and grouped.parameters[4].dtypes == ()
    assert found["self_attention_bf16"].parameters[0].dtypes == (torch.bfloat16,)
    assert found["attention_avx512"].parameters == () and found["attention_avx512"].returns is ctypes.c_int


@needs_kernels
def test_a_kernel_refuses_what_its_prototype_does_not_take():
    """A tensor of another dtype, a strided one, None where the C side does not take NULL, too few arguments,
    or tensors whose shapes do not fit together: an error, not memory read at random."""
    logits, which = torch.zeros(4, 10), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits takes a contiguous CPU tensor of torch.float32, got torch.float64"):
        KERNELS.call("log_softmax_rows", logits.double(), 4, 10, None, None, 1)
    with pytest.raises(ValueError, match="not contiguous"):
        KERNELS.call("log_softmax_rows", torch.zeros(10, 4).t(), 4, 10, None, None, 1)
    with pytest.raises(ValueError, match="which takes a contiguous CPU tensor of torch.int64, got torch.int32"):
        KERNELS.call("log_softmax_rows", logits, 4, 10, torch.zeros(2, 10), which.int(), 2)
    with pytest.raises(ValueError, match="logits takes"):
        KERNELS.call("log_softmax_rows", None, 4, 10, None, None, 1)
    with pytest.raises(TypeError, match="takes 6 arguments"):
        KERNELS.call("log_softmax_rows", logits, 4, 10)
    with pytest.raises(ValueError, match="shapes that do not fit together"):
        KERNELS.log_softmax_(logits, torch.zeros(2, 9), which)
    cache = torch.zeros(3, 2, 2, 4)  # 3 slots
    with pytest.raises(ValueError, match="shapes that do not fit together"):
        KERNELS.append_position(cache, 2, torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))  # slots 2 and 3


@needs_kernels
def test_beam_search_finds_what_torchs_operations_find(fresh_library, monkeypatch):
    """Beams, sentences leaving, padding, the shortlist-free path: the same translations and scores."""
    from nmt.generation.inference import TranslationRequest, translate_ids
    from nmt.generation.options import BatchingOptions, SearchOptions

    arch = get_arch("transformer_tiny")
    torch.manual_seed(3)
    model = build_model(arch.model_name, resolve_config(arch.config, {"dropout": 0.0}), 30, 30, 0).eval()
    g = torch.Generator().manual_seed(4)
    sources = [torch.cat([torch.randint(4, 30, (n,), generator=g), torch.tensor([3])]).numpy()
               for n in (3, 9, 5, 12, 1, 7)]
    request = TranslationRequest(SearchOptions(beam=4, nbest=2, max_len_b=8, stop="exact"),
                                 BatchingOptions(batch_size=4, max_tokens=None))
    model.backend = CpuKernelsBackend(KERNELS)
    with_kernels = translate_ids(model, sources, request)
    model.backend = TORCH
    with_torch = translate_ids(model, sources, request)
    assert [[h.tokens for h in hyps] for hyps in with_kernels] == [[h.tokens for h in hyps] for hyps in with_torch]
    torch.testing.assert_close(torch.tensor([[h.score for h in hyps] for hyps in with_kernels]),
                               torch.tensor([[h.score for h in hyps] for hyps in with_torch]), rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows, length, heads, head_dim", [(1, 1, 4, 16), (7, 5, 6, 8), (12, 33, 8, 64)])
def test_self_attention_reads_each_rows_history(rows, length, heads, head_dim):
    """Row r at position p reads slot starts[p] + history[p, r]: as attending to the gathered keys.
    (Heads by four and one by one; the usual head size 64 has loops of its own.)"""
    g = torch.Generator().manual_seed(rows)
    block_rows = torch.randint(rows, rows + 4, (length,), generator=g)  # a block per position, as wide as its step
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), block_rows.cumsum(0)])
    cache = torch.randn(int(starts[-1]), 2, heads, head_dim, generator=g)
    history = (torch.rand(length, rows, generator=g) * block_rows.unsqueeze(1)).int()
    query = torch.randn(rows, heads, head_dim, generator=g)
    gathered = cache[starts[:length].unsqueeze(1) + history]  # (length, rows, 2, heads, head_dim)
    keys, values = gathered[:, :, 0].permute(1, 2, 0, 3), gathered[:, :, 1].permute(1, 2, 0, 3)
    expected = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values).squeeze(2)
    out = KERNELS.self_attention(cache, starts, history, length, query)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows, length, heads, head_dim", [(3, 4, 4, 16), (9, 21, 8, 64), (5, 6, 3, 64)])
def test_a_bf16_cache_holds_torchs_rounding_and_is_read_as_its_float32_widening(rows, length, heads, head_dim):
    """Written: each key and value rounded to bf16 as torch rounds it. Read: what the float32 kernel
    reads from the cache widened to float32 (the sums stay float32, in another order: a bf16 cache
    is read in pairs of entries)."""
    g = torch.Generator().manual_seed(length)
    starts = torch.arange(length + 1, dtype=torch.int64) * rows
    cache = torch.zeros(length * rows, 2, heads, head_dim, dtype=torch.bfloat16)
    keys, values = torch.randn(2, length, rows, heads, 1, head_dim, generator=g) * 3
    for p in range(length):
        KERNELS.append_position(cache, p * rows, keys[p], values[p])
    torch.testing.assert_close(cache[:, 0], keys.reshape(-1, heads, head_dim).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(cache[:, 1], values.reshape(-1, heads, head_dim).to(torch.bfloat16), rtol=0, atol=0)
    history = torch.randint(0, rows, (length, rows), dtype=torch.int32, generator=g)
    query = torch.randn(rows, heads, head_dim, generator=g)
    out = KERNELS.self_attention(cache, starts, history, length, query)
    widened = KERNELS.self_attention(cache.float(), starts, history, length, query)
    torch.testing.assert_close(out, widened, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_int8_and_bf16_decoding_keep_a_bf16_cache_and_fp32_a_float32_one():
    """bf16 only where the keys and values were no more exact than that already."""
    from nmt.device import autocast

    fp32, int8 = CpuKernelsBackend(KERNELS), CpuKernelsBackend(KERNELS, int8=True)
    assert {layer.dtype for layer in fp32.new_cache(2).layers} == {torch.float32}
    assert {layer.dtype for layer in int8.new_cache(2).layers} == {torch.bfloat16}
    with autocast(torch.device("cpu"), "bf16"):
        assert {layer.dtype for layer in fp32.new_cache(2).layers} == {torch.bfloat16}


@needs_kernels
@pytest.mark.parametrize("head_dim", [8, 64])
def test_grouped_attention_keeps_to_each_sentence_and_skips_padding(head_dim):
    g = torch.Generator().manual_seed(0)
    sentences, group, heads, length = 3, 4, 2, 9
    keys, values = (torch.randn(sentences, heads, length, head_dim, generator=g) for _ in range(2))
    allowed = torch.ones(sentences, length, dtype=torch.bool)
    allowed[1, 6:] = False
    allowed[2, 1:] = False  # one real position: all weight on it
    query = torch.randn(sentences, group, heads, head_dim, generator=g)
    expected = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values,
                                              attn_mask=allowed[:, None, None, :]).transpose(1, 2)
    out = KERNELS.grouped_attention(keys, values, allowed, query)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2], values[2, :, 0].unsqueeze(0).expand(group, -1, -1))
    keys[1, :, 6:] = 1e4  # padding's keys and values count for nothing
    values[1, :, 6:] = float("nan")
    torch.testing.assert_close(KERNELS.grouped_attention(keys, values, allowed, query), out)


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64])
def test_grouped_attention_of_a_sentence_is_the_same_with_any_padding_after_it(head_dim):
    """To the bit (a batch's longest sentence sets the padding: an int8 model's rounding turned
    last-bit differences into other scores)."""
    g = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(1, 2, 7, head_dim, generator=g) for _ in range(2))
    query = torch.randn(1, 3, 2, head_dim, generator=g)
    alone = KERNELS.grouped_attention(keys, values, torch.ones(1, 7, dtype=torch.bool), query)
    for padding in (1, 2, 9, 30):
        padded_keys, padded_values = (torch.cat([t, torch.randn(1, 2, padding, head_dim, generator=g)], dim=2)
                                      for t in (keys, values))
        allowed = torch.arange(7 + padding)[None, :] < 7
        assert torch.equal(KERNELS.grouped_attention(padded_keys, padded_values, allowed, query), alone), padding


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64])  # the plain loops, and AVX-512's where built with it
def test_grouped_attention_reads_each_sentence_from_its_row(head_dim):
    """Beam search leaves the encoder's keys and values in place as sentences leave: row numbers say
    where each remaining sentence's are; the mask is the remaining sentences' own."""
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(4, 2, 7, head_dim, generator=g) for _ in range(2))
    allowed = torch.rand(4, 7, generator=g) > 0.3
    allowed[:, 0] = True
    rows = torch.tensor([3, 1, 3])
    query = torch.randn(3, 2, 2, head_dim, generator=g)
    expected = KERNELS.grouped_attention(keys[rows], values[rows], allowed[rows], query)
    assert torch.equal(KERNELS.grouped_attention(keys, values, allowed[rows], query, rows), expected)
    with pytest.raises(ValueError, match="rows"):
        KERNELS.grouped_attention(keys, values, allowed[rows], query, torch.tensor([0, 4, 1]))


@needs_kernels
def test_log_softmax_keeps_each_row_to_its_sentences_columns():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 8  # 3 sentences, 2 rows each
    logits[5, 7] = -float("inf")  # a column the model itself ruled out
    banned = torch.zeros(3, 300)
    banned[0, 100:] = -float("inf")
    banned[2, ::2] = -float("inf")
    expected = torch.log_softmax(logits.view(3, 2, 300) + banned.unsqueeze(1), dim=-1).view(6, 300)
    out = KERNELS.log_softmax_(logits.clone(), banned, torch.arange(3))
    assert torch.equal(out.isinf(), expected.isinf())
    torch.testing.assert_close(out[expected.isfinite()], expected[expected.isfinite()], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(KERNELS.log_softmax_(logits.clone(), None, torch.arange(3)),
                               torch.log_softmax(logits, dim=-1), rtol=1e-6, atol=1e-5)
    left = torch.tensor([2, 0])  # sentence 1 has left the batch: rows 0-1 are sentence 2's, 2-3 sentence 0's
    out = KERNELS.log_softmax_(logits[:4].clone(), banned, left)
    expected = torch.log_softmax(logits[:4].view(2, 2, 300) + banned[left].unsqueeze(1), dim=-1).view(4, 300)
    assert torch.equal(out.isinf(), expected.isinf())
    torch.testing.assert_close(out[expected.isfinite()], expected[expected.isfinite()], rtol=1e-6, atol=1e-5)


@needs_kernels
def test_log_softmax_of_a_row_is_the_same_with_any_minus_inf_columns_after_it():
    """To the bit, whether the logits or the ban put them there: a sentence's shortlist is as wide as
    its batch's widest, the rest -inf (before, the sum's vectorized order changed with the width)."""
    g = torch.Generator().manual_seed(0)
    for width in range(20, 400, 7):
        row = torch.randn(1, width, generator=g) * 3
        alone = KERNELS.log_softmax_(row.clone(), None, torch.arange(1))
        for extra in (1, 3, 9, 40, 300):
            minus_inf = torch.full((1, extra), -float("inf"))
            padded = KERNELS.log_softmax_(torch.cat([row, minus_inf], dim=1), None, torch.arange(1))
            banned = torch.cat([torch.zeros(1, width), minus_inf], dim=1)
            banned_after = KERNELS.log_softmax_(torch.cat([row, torch.randn(1, extra, generator=g)], dim=1), banned,
                                                torch.arange(1))
            for out in (padded, banned_after):
                assert torch.equal(out[:, :width], alone) and out[:, width:].isneginf().all(), (width, extra)


@needs_kernels
@pytest.mark.parametrize("columns", [3, 64, 300])
def test_select_top_chooses_as_torchs_operations(columns):
    """The best 2*beam continuations over a sentence's rows, in order; fewer columns than that (a tiny
    vocabulary) are filled with dead (-inf) candidates, banned columns are never chosen over others."""
    g = torch.Generator().manual_seed(columns)
    scores = torch.randn(5, 4, generator=g) * 3
    scores[1, 2] = -float("inf")  # a dead beam
    logprobs = torch.log_softmax(torch.randn(20, columns, generator=g) * 4, dim=-1)
    logprobs[:, ::3] = -float("inf")
    chosen = CpuKernelsBackend(KERNELS).select_top(scores, logprobs, 4)
    expected = TORCH.select_top(scores, logprobs, 4)
    torch.testing.assert_close(chosen[0], expected[0])
    finite = expected[0].isfinite()
    assert torch.equal(chosen[1][finite], expected[1][finite]) and torch.equal(chosen[2][finite], expected[2][finite])


@needs_kernels
def test_the_encoder_attends_the_same_with_them(monkeypatch):
    calls = []
    backend = CpuKernelsBackend(KERNELS)
    real = KERNELS.grouped_attention
    monkeypatch.setattr(KERNELS, "grouped_attention", lambda *args: calls.append(1) or real(*args))
    arch = get_arch("transformer_tiny")
    model = build_model(arch.model_name, resolve_config(arch.config, {}), 20, 20, 0).eval()
    src = torch.randint(4, 20, (3, 7), generator=torch.Generator().manual_seed(0))
    src[1, 4:] = 0  # padding
    with torch.inference_mode():
        expected = model.encode(src)  # training's (and any unprepared model's): torch's operations
        model.backend = backend
        with_kernels = model.encode(src)
    for (keys, values), (expected_keys, expected_values) in zip(with_kernels.memory, expected.memory):
        torch.testing.assert_close(keys, expected_keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    assert len(calls) == len(model.encoder_layers)  # the kernel did the encoder's attention, with its backend only


@pytest.fixture
def fresh_library(monkeypatch):
    """built_kernels() is asked once per process: forget its answer before and after the test."""
    kernel_build.built_kernels.cache_clear()
    monkeypatch.setattr(logger, "propagate", True)  # the CLI's logging set-up turns it off; caplog listens at root
    yield
    kernel_build.built_kernels.cache_clear()


def decoding_backend_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("decoding backend")]


@needs_kernels
def test_the_backend_is_chosen_once_and_said_in_one_line(fresh_library, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="nmt")  # -v; generate's last line names the backend
    assert isinstance(choose_backend(torch.device("cpu"), "int8"), CpuKernelsBackend)
    why = "built for this CPU; --backend torch or NMT_CPU_KERNELS=0 for PyTorch's operations"
    assert decoding_backend_lines(caplog) == [f"decoding backend: nmt's C kernels ({KERNELS.describe()}) ({why})"]
    assert "int8" not in choose_backend(torch.device("cpu")).describe()  # nothing quantized: no int8 said
    caplog.clear()
    assert choose_backend(torch.device("cpu"), backend="torch") is TORCH
    monkeypatch.setenv("NMT_CPU_KERNELS", "0")
    assert choose_backend(torch.device("cpu")) is TORCH
    assert choose_backend(torch.device("cuda")) is TORCH  # only chosen here, never run
    assert decoding_backend_lines(caplog) == ["decoding backend: PyTorch's operations (--backend torch)",
                                                  "decoding backend: PyTorch's operations (NMT_CPU_KERNELS=0)",
                                                  "decoding backend: PyTorch's operations (on cuda)"]


def test_without_a_compiler_decoding_uses_torchs_operations_and_says_so(fresh_library, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="nmt")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert choose_backend(torch.device("cpu")) is TORCH
    [line] = decoding_backend_lines(caplog)
    assert "CC='/nonexistent/cc': /nonexistent/cc not found" in line


@needs_kernels
def test_a_build_is_cached_and_reused(fresh_library, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_build.built_kernels()[0] is not None
    built = sorted((tmp_path / "nmt" / "kernels").iterdir())
    assert [path.suffix for path in built] == [".so", ".sha256"]
    stamp = built[0].stat().st_mtime_ns
    real_run, builds = kernel_build.subprocess.run, []

    def run(args, **kwargs):
        builds.extend([args] if "-o" in args else [])
        return real_run(args, **kwargs)

    monkeypatch.setattr(kernel_build.subprocess, "run", run)
    kernel_build.built_kernels.cache_clear()
    assert kernel_build.built_kernels()[0] is not None
    assert builds == [] and sorted((tmp_path / "nmt" / "kernels").iterdir()) == built
    assert built[0].stat().st_mtime_ns == stamp


LOADS = [sys.executable, "-c",
         "from nmt.backends import kernel_build; print(kernel_build.built_kernels()[0] is not None)"]


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "another library"])
def test_a_damaged_library_in_the_cache_is_built_again(tmp_path, damage):
    """Checked against the SHA-256 recorded beside it before it is loaded: loading a truncated one
    crashed the process (SIGBUS), another library fell back to torch's operations for good."""
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    assert subprocess.run(LOADS, env=environment, capture_output=True, text=True).stdout.strip() == "True"
    [built] = (tmp_path / "nmt" / "kernels").glob("*.so")
    whole = built.read_bytes()
    built.write_bytes(whole[:4096] if damage == "truncated" else Path(sys.executable).read_bytes())
    result = subprocess.run(LOADS, env=environment, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    assert built.read_bytes() == whole  # built again, not torch's operations for good


@needs_kernels
def test_a_model_prepared_for_decoding_on_cpu_decodes_with_them_and_trainings_never(untrained_checkpoint):
    from nmt.generation.inference import prepare_model

    model, _ = prepare_model(untrained_checkpoint, torch.device("cpu"))
    assert isinstance(model.backend, CpuKernelsBackend) and isinstance(model.new_cache(), IndexedDecoderCache)
    assert prepare_model(untrained_checkpoint, torch.device("cpu"), backend="torch")[0].backend is TORCH
    arch = get_arch("transformer_tiny")
    model = build_model(arch.model_name, resolve_config(arch.config, {}), 20, 20, 0)  # as training builds it
    assert model.backend is TORCH and type(model.new_cache()) is DecoderCache


def int8_projection_case(dim: int, group: int, seed: int = 0):
    """Rows of 3 sentences (``group`` each), an int8 weight of 100 rows with a scale each (from 1e-4 to
    1), each sentence's own columns (40, 16 and 17: more than one block of 16, and a block of one;
    ascending, the shorter lists repeating their last), their sums and scales, and the expected
    logits: each row quantized with a scale of its own, max |x| / 127, the products exact in integers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * group, dim, generator=g)
    x[0] = 0.0  # a row of zeros: scale 0, logits 0
    weight = torch.randint(-127, 128, (100, dim), generator=g, dtype=torch.int8)
    counts = torch.tensor([40, 16, 17], dtype=torch.int32)
    columns = torch.stack([torch.cat([ids, ids[-1:].expand(40 - len(ids))]) for ids in
                           (torch.randperm(100, generator=g)[:n].sort().values for n in counts.tolist())])
    sums = weight.sum(dim=1, dtype=torch.int32)[columns]
    scales = torch.logspace(-4, 0, 100)[torch.randperm(100, generator=g)][columns]
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(x / scale.clamp(min=1e-30))
    exact = torch.einsum("sgk,swk->sgw", q.view(3, group, dim).double(), weight[columns].double())
    expected = (exact * (scale.view(3, group, 1) * scales[:, None, :]).double()).float().view(3 * group, 40)
    past = torch.arange(40)[None, :].expand(3 * group, 40) >= counts.repeat_interleave(group)[:, None]
    expected[past] = -float("inf")
    return x, weight, columns, sums, scales, counts, expected


@needs_kernels
@pytest.mark.parametrize("dim", [32, 64, 100, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_the_int8_projection_gives_each_row_its_sentences_columns(dim, group):
    x, weight, columns, sums, scales, counts, expected = int8_projection_case(dim, group)
    out = KERNELS.project_columns_int8(x, weight, columns, sums, scales, counts)
    assert torch.equal(out.isinf(), expected.isinf())
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert (out[0, :40] == 0).all()  # a row of zeros: its logits are 0
    x[1, 3], x[2, 0] = float("nan"), float("inf")
    out = KERNELS.project_columns_int8(x, weight, columns, sums, scales, counts)
    own = expected[1:3].isfinite()
    assert out[1:3][own].isnan().all() and out[1:3][~own].isneginf().all()  # a row with a NaN or an inf: no logits
    with pytest.raises(ValueError, match="shapes that do not fit together"):
        KERNELS.project_columns_int8(x[:, 1:], weight, columns, sums, scales, counts)
    with pytest.raises(ValueError, match="x takes a CPU tensor, got one on meta"):
        KERNELS.project_columns_int8(x.to("meta"), weight, columns, sums, scales, counts)
    with pytest.raises(ValueError, match="column_scales"):
        KERNELS.project_columns_int8(x, weight, columns, sums, scales[:, 1:], counts)


def plain_build(directory: Path, without: str) -> Kernels:
    """The kernels built without an instruction set (``-mno-...``), loaded beside this CPU's."""
    library = directory / "plain.so"
    subprocess.run([*kernel_build.find_compiler(), *kernel_build.FLAGS, f"-mno-{without}", str(SOURCE),
                    "-o", str(library), "-lm"], check=True, timeout=120)
    return Kernels(ctypes.CDLL(str(library)))


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="needs x86")
def test_the_int8_projections_plain_loops_give_what_its_vnni_path_gives(tmp_path):
    """Built without AVX512-VNNI, the kernel takes its plain loops; their integer sums are the same,
    and so are the logits, to the bit."""
    plain = plain_build(tmp_path, "avx512vnni")
    assert not plain.int8_vnni
    x, weight, columns, sums, scales, counts, expected = int8_projection_case(100, 4, seed=1)
    out = plain.project_columns_int8(x, weight, columns, sums, scales, counts)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out, KERNELS.project_columns_int8(x, weight, columns, sums, scales, counts))


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="needs x86")
def test_the_int8_products_plain_loops_give_what_their_vnni_tiles_give(tmp_path):
    """Built without AVX512-VNNI, int8_linear takes plain loops: the same outputs to the bit, for
    rows, inputs and outputs that fill no tile, no group of 4 and no panel; and so do torch's int8
    product between the kernels' quantization and scaling."""
    plain = plain_build(tmp_path, "avx512vnni")
    g = torch.Generator().manual_seed(11)
    weight = torch.randint(-127, 128, (70, 250), dtype=torch.int8, generator=g)
    x = torch.randn(13, 250, generator=g) * torch.logspace(-3, 3, 13)[:, None]
    x[4] = 0
    padded = 80  # the outputs rounded up to 16
    sums = F.pad(weight.sum(dim=1, dtype=torch.int32), (0, padded - 70))
    scales = F.pad(torch.rand(70, generator=g) / 100, (0, padded - 70))
    bias = F.pad(torch.randn(70, generator=g), (0, padded - 70))
    out = plain.int8_linear(x, plain.pack_int8_weight(weight), 70, sums, scales, bias, True)
    quantized, row_scales = plain.int8_quantize_rows(x)
    through_torch = plain.int8_scale_outputs(torch._int_mm(quantized, weight.t()), row_scales, scales[:70],
                                             bias[:70], True)
    assert torch.equal(out, through_torch) and (out == 0).any() and out[4].equal(bias[:70].relu())
    if KERNELS.int8_vnni:
        assert not plain.int8_vnni
        assert torch.equal(KERNELS.int8_linear(x, KERNELS.pack_int8_weight(weight), 70, sums, scales, bias, True), out)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or KERNELS is None or not KERNELS.attention_avx512,
                    reason="needs x86 with AVX-512, a C compiler and the kernels built here")
def test_the_attention_kernels_plain_loops_give_what_their_avx512_path_gives(tmp_path):
    """Built without AVX-512, head size 64 takes the plain loops: the same attention, the sums in
    another order; a NaN query gives NaN for its row and head alone, either way."""
    plain = plain_build(tmp_path, "avx512f")
    assert not plain.attention_avx512
    g = torch.Generator().manual_seed(5)
    rows, length, heads, sentences = 8, 19, 4, 2
    starts = torch.arange(length + 1, dtype=torch.int64) * rows
    history = torch.randint(0, rows, (length, rows), dtype=torch.int32, generator=g)
    query = torch.randn(rows, heads, 64, generator=g)
    query[3, 1, 7] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(length * rows, 2, heads, 64, generator=g).to(dtype)
        out = plain.self_attention(cache, starts, history, length, query)
        expected = KERNELS.self_attention(cache, starts, history, length, query)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert expected[3, 1].isnan().all() and expected.isnan().sum() == 64
    keys, values = (torch.randn(sentences, heads, length, 64, generator=g) for _ in range(2))
    allowed = torch.ones(sentences, length, dtype=torch.bool)
    allowed[1, 11:] = False
    grouped_query = query.view(sentences, rows // sentences, heads, 64)
    out = plain.grouped_attention(keys, values, allowed, grouped_query)
    expected = KERNELS.grouped_attention(keys, values, allowed, grouped_query)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert expected.view(rows, heads, 64)[3, 1].isnan().all() and expected.isnan().sum() == 64


PLANTED = """#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("NMT_PLANTED_MARKER"), "w");
    if (f) fclose(f);
}
"""


@pytest.fixture(scope="module")
def built_with_a_loose_umask(tmp_path_factory):
    """The kernels built into a fresh cache under umask 002 (a group-writable default): (cache, library)."""
    root = tmp_path_factory.mktemp("kernel-cache")
    environment = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "TMPDIR": str(root)}
    code = "import os; os.umask(0o002); " + LOADS[2]
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True)
    assert result.stdout.strip() == "True", result.stderr
    [library] = (root / "cache" / "nmt" / "kernels").glob("*.so")
    return root / "cache", library


def planted_library(directory: Path) -> Path:
    """A library that, once loaded, leaves a file where $NMT_PLANTED_MARKER says: another user's code."""
    source = directory / "planted.c"
    source.write_text(PLANTED)
    library = directory / "planted.so"
    subprocess.run([*kernel_build.find_compiler(), "-shared", "-fPIC", str(source), "-o", str(library)], check=True,
                   timeout=120)
    return library


def private_copy(library: Path, directory: Path) -> None:
    """The built library, whole, in a cache directory of this user's alone."""
    directory.mkdir(mode=0o700, parents=True)
    shutil.copy(library, directory / library.name)
    shutil.copy(library.with_name(library.name + ".sha256"), directory / (library.name + ".sha256"))


def loads_with(cache: Path, temporary: Path, marker: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "XDG_CACHE_HOME": str(cache), "TMPDIR": str(temporary),
                   "NMT_PLANTED_MARKER": str(marker)}
    return subprocess.run(LOADS, env=environment, capture_output=True, text=True)


@needs_kernels
def test_the_cache_is_made_private_whatever_the_umask(built_with_a_loose_umask):
    cache, library = built_with_a_loose_umask
    for path in (cache / "nmt", cache / "nmt" / "kernels", library):
        assert os.stat(path).st_mode & 0o077 == 0, path  # neither group nor others may write (or read) there


@needs_kernels
@pytest.mark.parametrize("how", ["a cache others may write into", "a symlink in place of the library"])
def test_a_library_that_another_user_could_have_put_there_is_never_loaded(built_with_a_loose_umask, tmp_path, how):
    """Its SHA-256 beside it matches (anyone who can write the file can write that too): the owner, the
    mode and the file itself (not a symlink) are what is checked; the library is then taken from the
    private directory in the temporary one."""
    _, library = built_with_a_loose_umask
    planted, marker = planted_library(tmp_path), tmp_path / "ran"
    kernels = tmp_path / "cache" / "nmt" / "kernels"
    private_copy(library, kernels)
    if how == "a cache others may write into":
        shutil.copy(planted, kernels / library.name)
        kernels.chmod(0o777)
    else:
        (kernels / library.name).unlink()
        (kernels / library.name).symlink_to(planted)
    (kernels / (library.name + ".sha256")).write_text(hashlib.sha256(planted.read_bytes()).hexdigest())
    private_copy(library, tmp_path / f"nmt-kernels-{os.getuid()}")
    result = loads_with(tmp_path / "cache", tmp_path, marker)
    assert result.stdout.strip() == "True", result.stderr
    assert not marker.exists()


@needs_kernels
def test_the_library_is_hashed_and_loaded_from_one_descriptor(monkeypatch, tmp_path, built_with_a_loose_umask):
    """Replaced between the hash and the load, a library by path would be another file: loaded through
    its descriptor, it is the file that was hashed."""
    _, library = built_with_a_loose_umask
    private_copy(library, tmp_path / "kernels")
    planted = planted_library(tmp_path)
    hashed = kernel_build.sha256_of

    def then_replaced(fd):
        digest = hashed(fd)
        os.replace(planted, tmp_path / "kernels" / library.name)  # by another process, say
        return digest

    monkeypatch.setattr(kernel_build, "sha256_of", then_replaced)
    descriptor = kernel_build.private_directory(tmp_path / "kernels")
    found = kernel_build.open_whole(descriptor, library.name)
    os.close(descriptor)
    assert found is not None
    assert Kernels(kernel_build.load_library(found)).functions  # the kernels, not the plant
