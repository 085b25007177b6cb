"""Attention weights: the explicit path equals the SDPA path, and alignments read them right."""

import numpy as np
import pytest
import torch

from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.generation.alignment import (
    cross_attention,
    format_alignment,
    hard_alignment,
    word_attention,
    word_attentions,
    word_ids,
    words,
)
from nmt.models.attention import MultiHeadAttention
from nmt.models.attention_maps import attention_maps, explicit_attention
from nmt.models.registry import build_model, get_arch


def tiny_model(vocab: int = 30) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("transformer", get_arch("transformer_tiny").config, vocab, vocab, PAD_ID).eval()


@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_explicit_attention_equals_sdpa(masking):
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4).eval()
    query, memory = torch.randn(3, 5, 16), torch.randn(3, 5 if masking == "causal" else 7, 16)
    key, value = attention.project_kv(memory)
    kwargs = {}
    if masking == "padding":
        allowed = torch.ones(3, 7, dtype=torch.bool)
        allowed[0, 4:] = False
        kwargs["mask"] = allowed[:, None, None, :]
    elif masking == "causal":
        kwargs["is_causal"] = True
    out, weights = explicit_attention(attention, query, (key, value), **kwargs)
    torch.testing.assert_close(out, attention(query, (key, value), **kwargs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 5))
    if masking == "padding":
        assert weights[0, :, :, 4:].abs().max() == 0
    if masking == "causal":
        assert weights[:, :, 0, 1:].abs().max() == 0 and weights[:, :, -1, :].min() > 0


def test_recorded_maps_reproduce_every_layer_of_the_model():
    model = tiny_model()
    source = torch.tensor([[5, 6, 7, 8, EOS_ID], [9, 10, EOS_ID, PAD_ID, PAD_ID]])
    prev = torch.tensor([[BOS_ID, 11, 12, 13], [BOS_ID, 14, PAD_ID, PAD_ID]])
    checked = []

    def check(module, args, kwargs, output):
        torch.testing.assert_close(explicit_attention(module, *args, **kwargs)[0], output, rtol=1e-5, atol=1e-5)
        checked.append(module)

    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    handles = [m.register_forward_hook(check, with_kwargs=True) for m in modules]
    maps = attention_maps(model, source, prev)
    for handle in handles:
        handle.remove()
    assert len(checked) == len(modules) == 6
    layers = len(model.decoder_layers)
    assert len(maps.encoder) == len(maps.decoder) == len(maps.cross) == layers
    assert maps.encoder[0].shape == (2, 4, 5, 5) and maps.cross[1].shape == (2, 4, 4, 5)
    assert maps.cross[0][1, :, :, 3:].abs().max() == 0  # padded source positions get nothing
    assert maps.decoder[0][0, :, 0, 1:].abs().max() == 0  # no look-ahead
    torch.testing.assert_close(maps.cross[1].sum(-1), torch.ones(2, 4, 4))


def test_attention_maps_leave_the_model_as_it_was():
    model = tiny_model().train()
    attention_maps(model, torch.tensor([[5, EOS_ID]]), torch.tensor([[BOS_ID]]))
    assert model.training
    assert not any(m._forward_hooks for m in model.modules())


def test_cross_attention_per_pair_drops_padding():
    model = tiny_model()
    sources = [np.array([5, 6, 7, EOS_ID]), np.array([8, EOS_ID])]
    targets = [[11, 12, EOS_ID], [13, 14, 15, 16, EOS_ID]]
    matrices = cross_attention(model, sources, targets, layer=-2, device=torch.device("cpu"), batch_size=1)
    batched = cross_attention(model, sources, targets, layer=-2, device=torch.device("cpu"))
    assert [m.shape for m in matrices] == [(3, 4), (5, 2)]
    for one, together in zip(matrices, batched):
        torch.testing.assert_close(one, together, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(one.sum(-1), torch.ones(one.size(0)))
    with pytest.raises(ValueError):
        cross_attention(model, sources, targets, layer=5, device=torch.device("cpu"))


def test_pieces_group_into_the_words_of_the_text():
    pieces = ["\u2581Ein", "\u2581Hund", "e", "\u2581läuft", "."]
    assert word_ids(pieces) == [0, 1, 1, 2, 2]
    assert words(pieces) == ["Ein", "Hunde", "läuft."]
    assert words(["ab", "\u2581c"]) == ["ab", "c"]


def test_word_alignment_from_piece_attention():
    source = ["\u2581a", "\u2581b", "c"]  # words: a, bc
    target = ["\u2581x", "y", "\u2581z"]  # words: xy, z
    attention = torch.tensor([[0.1, 0.8, 0.1, 0.0],  # x -> b (word 1)
                              [0.7, 0.1, 0.1, 0.1],  # y -> a (word 0)
                              [0.9, 0.0, 0.0, 0.1],  # z -> a
                              [0.0, 0.0, 0.0, 1.0]])  # EOS row: dropped
    soft = word_attention(attention, source, target)
    torch.testing.assert_close(soft, torch.tensor([[0.4, 0.55], [0.9, 0.0]]))
    assert hard_alignment(soft) == [(1, 0), (0, 1)]
    assert format_alignment(hard_alignment(soft)) == "1-0 0-1"
    assert hard_alignment(word_attention(torch.ones(1, 1), [], [])) == []


COPY_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel".split()


@pytest.mark.slow
def test_a_model_trained_to_copy_aligns_on_the_diagonal(tmp_path):
    """Learned behaviour: copying 3-5 distinct words, the last layer's links mostly pair word i with word i."""
    import random

    from conftest import make_data_dir

    from nmt.generation.inference import prepare_model
    from nmt.training.config import load_train_config
    from nmt.training.trainer import train

    rng = random.Random(0)
    sentences = [" ".join(rng.sample(COPY_WORDS, rng.randint(3, 5))) for _ in range(540)]
    data = make_data_dir(tmp_path / "data", {"train": [(s, s) for s in sentences[:500]],
                                             "valid": [(s, s) for s in sentences[500:]]}, vocab_size=40)
    train(load_train_config({"data": str(data), "arch": "transformer_tiny", "save_dir": str(tmp_path / "ckpt"),
                             "max_tokens": 1000, "lr": 3e-3, "warmup_updates": 50, "max_update": 300,
                             "model": {"dropout": 0.0}, "valid_subset": "none"}))
    model, vocabs = prepare_model(tmp_path / "ckpt" / "checkpoint_last.pt", torch.device("cpu"))
    sources = [np.asarray(vocabs.source.encode(s) + [EOS_ID]) for s in sentences[500:]]
    attentions = word_attentions(model, vocabs, sources, [list(s) for s in sources], layer=-1,
                                 device=torch.device("cpu"))
    links = [pair for a in attentions for pair in hard_alignment(a.weights)]
    assert all(a.source_words == s.split() for a, s in zip(attentions, sentences[500:]))
    on_diagonal = sum(source == target for source, target in links) / len(links)
    assert on_diagonal >= 0.7, f"{on_diagonal:.0%} of the links on the diagonal"  # untrained: about 1 in 4
