"""Beam search steps and the whole search on a tiny random Transformer."""

import itertools

import pytest
import torch

from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.generation.search import (SearchOptions, beam_search, constrain, length_penalty, max_lengths,
                                   select_top)
from nmt.models.registry import build_model, get_arch, resolve_config

VOCAB = 7  # PAD UNK BOS EOS + three words


def peaky_model(seed: int, vocab: int = VOCAB):
    """A random tiny model whose distributions are far from uniform (no near-ties)."""
    torch.manual_seed(seed)
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"dropout": 0.0, "d_model": 32, "ffn_dim": 64})
    model = build_model(arch.model_name, config, vocab, vocab, PAD_ID).eval()
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4.0)
    return model


def sources(*rows: list[int]) -> torch.Tensor:
    length = max(len(r) for r in rows) + 1
    return torch.tensor([r + [EOS_ID] + [PAD_ID] * (length - len(r) - 1) for r in rows])


def sequence_logprob(model, source: torch.Tensor, tokens: list[int]) -> float:
    prev = torch.tensor([[BOS_ID] + tokens[:-1]])
    logprobs = model(source, prev)[0].float().log_softmax(-1)
    return float(sum(logprobs[i, t] for i, t in enumerate(tokens)))


def test_length_penalties():
    lengths = torch.tensor([1, 7])
    torch.testing.assert_close(length_penalty(lengths, 0.6), ((5 + lengths.float()) / 6) ** 0.6)
    torch.testing.assert_close(length_penalty(lengths, 0.6, "fairseq"), lengths.float() ** 0.6)
    assert torch.equal(length_penalty(lengths, 0.0), torch.ones(2))


def test_max_lengths_is_a_times_source_plus_b():
    assert max_lengths(torch.tensor([0, 10, 31]), 1.0, 50).tolist() == [50, 60, 81]
    assert max_lengths(torch.tensor([10]), 1.5, 2).tolist() == [17]


def test_constrain_bans_specials_short_eos_and_forces_eos_at_the_limit():
    logprobs = torch.zeros(2, VOCAB).log_softmax(-1)
    tokens = torch.tensor([[BOS_ID, 4], [BOS_ID, 5]])
    out = constrain(logprobs.clone(), tokens, step=1, max_len=torch.tensor([5, 1]), min_len=2, no_repeat_ngram_size=0)
    assert out[0, PAD_ID] == out[0, BOS_ID] == out[0, EOS_ID] == float("-inf")
    assert torch.isfinite(out[0, 4:]).all()
    assert torch.isfinite(out[1]).tolist() == [i == EOS_ID for i in range(VOCAB)]  # row 1 is at its limit


def test_no_repeat_ngram_bans_exactly_the_repeating_token():
    tokens = torch.tensor([[BOS_ID, 4, 5, 6, 4]])  # the bigram (4, 5) was seen; last token is 4
    out = constrain(torch.zeros(1, VOCAB), tokens, step=4, max_len=torch.tensor([50]), min_len=0,
                    no_repeat_ngram_size=2)
    assert out[0, 5] == float("-inf")
    assert torch.isfinite(out[0, [4, 6, EOS_ID]]).all()


def test_select_top_returns_best_continuations_with_their_beams():
    scores = torch.full((1, 2, 4), -10.0)
    scores[0, 1, 3], scores[0, 0, 2], scores[0, 1, 0] = -1.0, -2.0, -3.0
    best, beams, tokens = select_top(scores, beam=2)
    assert best[0, :3].tolist() == [-1.0, -2.0, -3.0]
    assert beams[0, :3].tolist() == [1, 0, 1] and tokens[0, :3].tolist() == [3, 2, 0]


@pytest.mark.parametrize("lenpen", [0.0, 0.6])
def test_full_beam_finds_the_exhaustive_optimum(lenpen):
    model = peaky_model(seed=3)
    source = sources([4, 5, 6])
    limit, words = 3, [1, 4, 5, 6]  # max output length; tokens a hypothesis may use besides EOS
    best_score, best_tokens = float("-inf"), None
    with torch.no_grad():
        for length in range(1, limit + 1):
            for body in itertools.product(words, repeat=length):
                tokens = list(body) + [EOS_ID]
                score = sequence_logprob(model, source, tokens) / float(length_penalty(torch.tensor(length + 1), lenpen))
                if score > best_score:
                    best_score, best_tokens = score, tokens
        options = SearchOptions(beam=len(words) ** limit, lenpen=lenpen, max_len_a=0.0, max_len_b=limit)
        found = beam_search(model, source, options)[0][0]
    assert found.tokens == best_tokens
    assert found.score == pytest.approx(best_score, abs=1e-4)


def greedy(model, source: torch.Tensor, max_len: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < max_len:
        logprobs = model(source, torch.tensor([[BOS_ID] + tokens]))[0, -1].float()
        logprobs[[PAD_ID, BOS_ID]] = float("-inf")
        if not tokens:
            logprobs[EOS_ID] = float("-inf")  # min_len 1
        tokens.append(int(logprobs.argmax()))
        if tokens[-1] == EOS_ID:
            return tokens
    return tokens + [EOS_ID]


def test_beam_one_is_greedy():
    for seed in range(4):
        model = peaky_model(seed, vocab=12)
        source = sources([4, 5, 6, 7, 8])
        with torch.no_grad():
            found = beam_search(model, source, SearchOptions(beam=1, lenpen=0.0, max_len_a=1.0, max_len_b=5))[0][0]
            assert found.tokens == greedy(model, source, max_len=10)


def test_positional_scores_sum_to_the_unnormalized_score():
    model = peaky_model(seed=1)
    with torch.no_grad():
        hyp = beam_search(model, sources([4, 5]), SearchOptions(beam=3, lenpen=0.6, max_len_b=10))[0][0]
    penalty = float(length_penalty(torch.tensor(len(hyp.tokens)), 0.6))
    assert sum(hyp.positional_scores) / penalty == pytest.approx(hyp.score, abs=1e-4)
    assert len(hyp.positional_scores) == len(hyp.tokens) and hyp.tokens[-1] == EOS_ID


def test_higher_lenpen_never_shortens_the_best_hypothesis():
    longer = 0
    for seed in range(4):
        model = peaky_model(seed, vocab=12)
        source = sources([4, 5, 6, 7, 8, 9])
        with torch.no_grad():
            short = beam_search(model, source, SearchOptions(beam=4, lenpen=0.0, max_len_b=12))[0][0]
            long = beam_search(model, source, SearchOptions(beam=4, lenpen=2.0, max_len_b=12))[0][0]
        assert len(long.tokens) >= len(short.tokens)
        longer += len(long.tokens) > len(short.tokens)
    assert longer > 0  # the penalty does change lengths on some of these models


def test_max_length_and_min_length_are_respected():
    model = peaky_model(seed=2, vocab=12)
    source = sources([4, 5, 6])
    with torch.no_grad():
        for hyp in beam_search(model, source, SearchOptions(beam=4, nbest=4, max_len_a=0.0, max_len_b=2))[0]:
            assert len(hyp.tokens) <= 3
        for hyp in beam_search(model, source, SearchOptions(beam=4, nbest=4, min_len=5, max_len_b=10))[0]:
            assert len(hyp.tokens) >= 6


def test_nbest_is_sorted_and_distinct():
    model = peaky_model(seed=4, vocab=12)
    with torch.no_grad():
        hyps = beam_search(model, sources([4, 5, 6]), SearchOptions(beam=5, nbest=5, max_len_b=10))[0]
    assert len(hyps) == 5
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert len({tuple(h.tokens) for h in hyps}) == 5


def test_batched_search_equals_one_sentence_at_a_time():
    model = peaky_model(seed=5, vocab=12)
    rows = [[4, 5, 6, 7, 8, 9, 10], [4], [11, 10, 9], [5, 5, 5, 5], [6, 7]]
    options = SearchOptions(beam=3, nbest=3, max_len_b=10)
    with torch.no_grad():
        batched = beam_search(model, sources(*rows), options)
        alone = [beam_search(model, sources(row), options)[0] for row in rows]
    assert [[h.tokens for h in hyps] for hyps in batched] == [[h.tokens for h in hyps] for hyps in alone]


def test_sampling_is_reproducible_with_a_seed_and_varies_without():
    model = peaky_model(seed=6, vocab=12)
    source = sources([4, 5, 6])
    options = SearchOptions(beam=4, nbest=4, sampling=True, temperature=1.5, max_len_b=8)

    def sample(seed: int) -> list[list[int]]:
        with torch.no_grad():
            return [h.tokens for h in beam_search(model, source, options, torch.Generator().manual_seed(seed))[0]]

    assert sample(1) == sample(1)
    assert any(sample(1) != sample(seed) for seed in range(2, 6))


def test_topk_one_sampling_is_greedy():
    model = peaky_model(seed=7, vocab=12)
    source = sources([4, 5, 6, 7])
    with torch.no_grad():
        sampled = beam_search(model, source, SearchOptions(beam=1, lenpen=0.0, sampling=True, topk=1, max_len_b=6),
                              torch.Generator().manual_seed(0))[0][0]
    assert sampled.tokens == greedy(model, source, max_len=10)
