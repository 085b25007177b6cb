"""Target prefixes, lexical constraints and banned phrases: the constraint state's small steps, the
whole search on the scripted toy decoder of test_search.py (against exhaustive search), and the
text forms users give them in."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, both_search_paths, needs_ct2, run_cli, run_nmt, train_tiny_checkpoint
from test_search import VOCAB, WORDS, ToyDecoder, random_table, scripted_table, search, sources, table_logprob
from test_translator import tiny_checkpoint

from nmt import Translator
from nmt.data.vocabulary import EOS_ID, UNK_ID, Vocabulary
from nmt.errors import NmtError
from nmt.generation.constraints import (
    BatchControls,
    SentenceControls,
    advance,
    contains,
    progress,
    rank_in_bank,
    transitions,
)
from nmt.generation.control_input import (
    controls_from_lists,
    lines_with_controls,
    sentence_controls,
    split_line,
    warn_of_tabs,
)
from nmt.generation.inference import check_controls, warn_unmet
from nmt.generation.options import SearchOptions
from nmt.generation.search import NEG_INF, beam_search, length_penalty

CPU = torch.device("cpu")


def controlled(table, source: list[int], controls: SentenceControls | None, **options):
    """The hypotheses of one sentence with its controls."""
    generator = options.pop("generator", None)
    return beam_search(ToyDecoder(table), sources(source), SearchOptions(**{"stop": "exact", **options}), generator,
                       BatchControls.create([controls], CPU))[0]


def exhaustive_with(table, source: list[int], max_len: int, lenpen: float, controls: SentenceControls
                    ) -> tuple[list[int], float]:
    """The best normalized score over every output of 1..max_len words that starts with the prefix,
    contains every constraint and no banned phrase (prefix tokens count 0 in the score)."""
    key = tuple(source) + (EOS_ID,)
    prefix = controls.prefix
    best: tuple[list[int], float] = ([], NEG_INF)
    for length in range(max(1, len(prefix)), max_len + 1):
        for body in itertools.product(WORDS, repeat=length - len(prefix)):
            words = prefix + list(body)
            if (not all(contains(words, c) for c in controls.constraints)
                    or any(contains(words, b) for b in controls.bans)):
                continue
            tokens = words + [EOS_ID]
            logprob = table_logprob(table, key, tokens) - table_logprob(table, key, prefix)
            score = logprob / float(length_penalty(torch.tensor(length + 1), lenpen))
            if score > best[1]:
                best = (tokens, score)
    return best


# --- the constraint state --------------------------------------------------------------------------

def longest_match(output: list[int], phrase: list[int]) -> int:
    return max(j for j in range(len(phrase) + 1) if j <= len(output) and output[len(output) - j:] == phrase[:j])


def test_transitions_give_the_longest_prefix_of_the_phrase_ending_the_output():
    rng = random.Random(0)
    for _ in range(200):
        phrase = [rng.choice([4, 5]) for _ in range(rng.randint(1, 5))]
        table = transitions(phrase)
        output: list[int] = []
        state = 0
        for token in [rng.choice([4, 5]) for _ in range(12)]:
            state = table[state][phrase.index(token)] if token in phrase else 0
            output.append(token)
            assert state == longest_match(output, phrase) or (state == len(phrase) == longest_match(output, phrase))


def run_advance(phrases: list[list[int]], output: list[int]) -> tuple[list[int], list[bool]]:
    controls = BatchControls([SentenceControls(constraints=phrases)], CPU)
    matched, met = controls.matched, controls.met
    for token in output:
        matched, met = advance(controls.pieces, controls.table, controls.lengths, matched, met, torch.tensor([token]))
    return matched[0].tolist(), met[0].tolist()


def test_a_constraint_is_met_wherever_it_starts_and_after_an_abandoned_start():
    assert run_advance([[4, 4, 5]], [4, 4, 4, 5]) == ([0], [True])  # restarting from scratch would miss it
    assert run_advance([[4, 5]], [6, 4, 6, 4, 5, 6]) == ([0], [True])
    assert run_advance([[4, 5], [6]], [4, 6, 4]) == ([1, 0], [False, True])
    assert run_advance([[4, 5, 6]], [4, 5, 4]) == ([1], [False])  # abandoned at "4 5 4": "4" ends the output again
    rng = random.Random(1)
    for _ in range(100):
        phrases = [[rng.choice([4, 5, 6]) for _ in range(rng.randint(1, 3))] for _ in range(2)]
        output = [rng.choice([4, 5, 6]) for _ in range(8)]
        matched, met = run_advance(phrases, output)
        assert met == [contains(output, p) for p in phrases]
        assert matched == [0 if m else longest_match(output, p) for p, m in zip(phrases, met)]


def test_the_bank_rises_with_the_next_piece_of_the_longest_partial_match():
    lengths = torch.tensor([[2, 3]])
    assert progress(torch.tensor([[1, 2]]), torch.tensor([[False, False]]), lengths).tolist() == [2]
    assert progress(torch.tensor([[0, 2]]), torch.tensor([[True, False]]), lengths).tolist() == [4]
    assert progress(torch.tensor([[0, 0]]), torch.tensor([[True, True]]), lengths).tolist() == [5]


def test_rank_in_bank_ranks_by_score_within_each_bank():
    values = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -0.1]])
    bank = torch.tensor([[1, 0, 1, 1, -1]])
    assert rank_in_bank(bank, values)[0, :4].tolist() == [1, 0, 0, 2]


# --- restrict: the bans, the prefix and EOS ------------------------------------------------------

def restricted(controls: SentenceControls, generated: list[int], step: int, limit: int = 10) -> torch.Tensor:
    batch = BatchControls([controls], CPU)
    batch.begin(torch.tensor([limit]))
    logprobs = torch.zeros(1, VOCAB)
    batch.restrict(logprobs, torch.tensor([[2] + generated]), step)
    return logprobs[0]


def test_a_banned_phrase_is_blocked_at_its_last_piece_only_after_the_rest():
    bans = SentenceControls(bans=[[4, 5], [6]])
    assert torch.isinf(restricted(bans, [4], 1)[[5, 6]]).all()
    after_five = restricted(bans, [5], 1)
    assert torch.isfinite(after_five[5]) and torch.isinf(after_five[6])
    assert torch.isfinite(restricted(bans, [], 0)[5])  # at the start nothing precedes: "4 5" cannot end yet


def test_the_prefix_is_forced_with_log_probability_zero_and_then_released():
    forced = restricted(SentenceControls(prefix=[5, 4]), [5], 1)
    assert forced[4] == 0.0 and torch.isinf(forced[torch.arange(VOCAB) != 4]).all()
    assert torch.isfinite(restricted(SentenceControls(prefix=[5, 4]), [5, 4], 2)).all()


def test_eos_waits_for_the_constraints_until_the_max_length():
    waiting = SentenceControls(constraints=[[6]])
    assert torch.isinf(restricted(waiting, [4], 1)[EOS_ID])
    assert torch.isfinite(restricted(waiting, [4], 1, limit=1)[EOS_ID])
    batch = BatchControls([waiting], CPU)
    batch.begin(torch.tensor([10]))
    batch.reorder(torch.tensor([0]), torch.tensor([6]))  # the row appended the constraint
    logprobs = torch.zeros(1, VOCAB)
    batch.restrict(logprobs, torch.tensor([[2, 6]]), 1)
    assert torch.isfinite(logprobs[0, EOS_ID])


def test_restrict_works_in_each_sentences_columns_of_a_shortlist():
    columns = torch.tensor([[0, 1, 2, 3, 5, 6, 6], [0, 1, 2, 3, 4, 5, 6]])  # the first has no token 4
    controls = SentenceControls(prefix=[6], bans=[[5]], constraints=[[5, 6]])
    assert controls.required_tokens() == {5, 6}
    batch = BatchControls([controls, controls], CPU)
    batch.begin(torch.tensor([10, 10]), columns)
    logprobs = torch.zeros(2, 7)
    batch.restrict(logprobs, torch.tensor([[2], [2]]), 0)
    assert logprobs.tolist() == [[NEG_INF] * 5 + [0.0, NEG_INF], [NEG_INF] * 6 + [0.0]]  # token 6, the prefix
    logprobs = torch.zeros(2, 7)
    batch.restrict(logprobs, torch.tensor([[2, 6], [2, 6]]), 1)
    # EOS (column 3) waits for the constraints; the banned token 5 is column 4 of the first, 5 of the second
    assert torch.isinf(logprobs[0, [3, 4]]).all() and torch.isfinite(logprobs[0, [0, 1, 2, 5, 6]]).all()
    assert torch.isinf(logprobs[1, [3, 5]]).all() and torch.isfinite(logprobs[1, [0, 1, 2, 4, 6]]).all()
    assert batch.column(torch.tensor([[4], [4]])).tolist() == [[-1], [4]]  # outside the first's shortlist


# --- the whole search ----------------------------------------------------------------------------

CONTROLS = [SentenceControls(constraints=[[6]]), SentenceControls(constraints=[[5, 6]]),
            SentenceControls(constraints=[[6, 4], [UNK_ID]]), SentenceControls(constraints=[[4, 4, 4]]),
            SentenceControls(prefix=[5], constraints=[[4]]), SentenceControls(prefix=[6, 6], bans=[[4]]),
            SentenceControls(constraints=[[5]], bans=[[4, 5], [6, 6]])]


@both_search_paths
@pytest.mark.parametrize("controls", CONTROLS, ids=range(len(CONTROLS)))
@pytest.mark.parametrize("lenpen", [0.0, 0.6])
def test_a_full_beam_finds_the_best_output_that_obeys_the_controls(controls, lenpen):
    limit = 3
    for seed in range(2):
        table = random_table(seed)
        expected, score = exhaustive_with(table, [4, 5], limit, lenpen, controls)
        found = controlled(table, [4, 5], controls, beam=(len(WORDS) + 1) ** limit, lenpen=lenpen,
                           max_len_a=0.0, max_len_b=limit)[0]
        assert found.tokens == expected
        assert found.score == pytest.approx(score, abs=1e-5)


def test_the_unconstrained_best_misses_these_constraints():
    """The exhaustive tests above have work to do: most tables' best output lacks the constraint."""
    missing = sum(not contains(search(random_table(seed), [4, 5], beam=125, max_len_a=0.0, max_len_b=3)[0].tokens,
                               [4, 4, 4])
                  for seed in range(2))
    assert missing == 2


@both_search_paths
@pytest.mark.parametrize("beam", [1, 2, 4])
def test_every_constraint_appears_in_every_hypothesis_at_any_beam(beam):
    rng = random.Random(beam)
    for seed in range(6):
        phrases = [[rng.choice(WORDS) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
        hyps = controlled(random_table(seed, sharpness=3.0), [4, 5, 6], SentenceControls(constraints=phrases),
                          beam=beam, nbest=beam, max_len_b=4)
        assert len(hyps) >= 1
        for hyp in hyps:
            assert all(contains(hyp.tokens, p) for p in phrases), (phrases, hyp.tokens)


@both_search_paths
def test_an_unlikely_constraint_is_placed_and_the_score_is_the_models():
    table = scripted_table({}, default={4: 0.9, EOS_ID: 0.05})  # 6 has probability 0.01 everywhere
    assert 6 not in search(table, [4], beam=4, max_len_b=5)[0].tokens
    hyp = controlled(table, [4], SentenceControls(constraints=[[6, 6]]), beam=4, max_len_b=5)[0]
    assert contains(hyp.tokens, [6, 6])
    assert sum(hyp.positional_scores) == pytest.approx(table_logprob(table, (4, EOS_ID), hyp.tokens), abs=1e-5)


@both_search_paths
def test_hypotheses_that_meet_the_constraints_end_as_among_the_beam_best_of_their_bank():
    """Every likely output holds the constraint 6: both "6 4 EOS" and "6 5 EOS" end at step 2, the
    second as its bank's second best, and the search gives what it gives without the constraint (at
    beam 3: two places for bank 1, one for bank 0, which dynamic beam allocation keeps)."""
    table = scripted_table({(): {6: 0.9}, (6,): {4: 0.5, 5: 0.45}, (6, 4): {EOS_ID: 0.9}, (6, 5): {EOS_ID: 0.9}})
    options = {"beam": 3, "nbest": 2, "lenpen": 0.0, "max_len_b": 6}
    found = [h.tokens for h in controlled(table, [4], SentenceControls(constraints=[[6]]), **options)]
    assert found == [[6, 4, EOS_ID], [6, 5, EOS_ID]] == [h.tokens for h in search(table, [4], **options)]


@both_search_paths
def test_no_controls_give_todays_output():
    table = random_table(3)
    options = {"beam": 3, "nbest": 3, "max_len_b": 5}
    today = search(table, [4, 5, 6], **options)
    assert BatchControls.create([None, SentenceControls()], CPU) is None
    with_nothing = controlled(table, [4, 5, 6], SentenceControls(bans=[[6] * 9]), **options)  # longer than any output
    assert [(h.tokens, h.score, h.positional_scores) for h in with_nothing] == \
        [(h.tokens, h.score, h.positional_scores) for h in today]


@both_search_paths
def test_a_mixed_batch_gives_each_sentence_what_it_gets_alone():
    decoder = ToyDecoder(random_table(5, sharpness=1.0))
    rows = [[4, 5, 6, 4, 5, 6, 4], [4], [6, 5, 4], [5, 5, 5, 5], [6, 4]]
    controls = [SentenceControls(constraints=[[6, 6], [UNK_ID]]), None, SentenceControls(prefix=[5, 4], bans=[[6]]),
                SentenceControls(constraints=[[4, 5]], bans=[[5, 5]]), None]
    options = SearchOptions(beam=3, nbest=3, max_len_b=6, stop="exact")
    batched = beam_search(decoder, sources(*rows), options, None, BatchControls.create(controls, CPU))
    alone = [beam_search(decoder, sources(row), options, None, BatchControls.create([c], CPU))[0]
             for row, c in zip(rows, controls)]
    assert [[(h.tokens, h.score) for h in hyps] for hyps in batched] == \
        [[(h.tokens, h.score) for h in hyps] for hyps in alone]


@both_search_paths
def test_an_end_ranked_below_the_beam_best_of_its_bank_does_not_finish():
    """Every output begins with the constraint, 6. At step 1 "6 EOS" is the third best of bank 1
    (behind "6 4" and "6 5"): at beam 2 it does not finish, as plain beam search does not finish the
    third of its candidates, though its score would beat every output the search finds."""
    scripted = scripted_table({(6,): {4: 0.5, 5: 0.3, EOS_ID: 0.15}, (6, 4): {EOS_ID: 0.25, 4: 0.7},
                               (6, 5): {EOS_ID: 0.25, 5: 0.7}}, default={EOS_ID: 0.3})

    def table(source: tuple[int, ...], prefix: tuple[int, ...]) -> torch.Tensor:  # every output begins with 6
        return torch.full((VOCAB,), NEG_INF).index_fill(0, torch.tensor([6]), 0.0) if not prefix else \
            scripted(source, prefix)

    options = {"beam": 2, "nbest": 2, "lenpen": 0.0, "max_len_b": 4}
    found = [h.tokens for h in controlled(table, [4], SentenceControls(constraints=[[6]]), **options)]
    plain = [h.tokens for h in search(table, [4], **options)]
    assert found == plain and [6, EOS_ID] not in found
    assert exhaustive_with(table, [4], 4, 0.0, SentenceControls(constraints=[[6]]))[0] == [6, EOS_ID]  # work to do


def only_six_first_table(source: tuple[int, ...], prefix: tuple[int, ...]) -> torch.Tensor:
    """A model that can say 6 only first, and after it only EOS; it prefers "4 4 4 ..." over it."""
    probs = torch.zeros(VOCAB)
    if prefix == ():
        probs[[4, 5, 6]] = torch.tensor([0.9, 0.05, 0.05])
    elif prefix == (6,):
        probs[EOS_ID] = 1.0
    else:
        probs[[UNK_ID, 4, 5, EOS_ID]] = torch.tensor([0.01, 0.9, 0.01, 0.08])
    return probs.log()


@both_search_paths
def test_once_a_hypothesis_ended_with_every_constraint_none_ends_at_the_max_length_without_them():
    """"6 EOS" ends at step 1; the other beams can never place 6 and are forced to end at the max
    length: the sentence had an output with its constraint, so they do not finish."""
    for nbest in (1, 2):
        hyps = controlled(only_six_first_table, [4], SentenceControls(constraints=[[6]]), beam=2, nbest=nbest,
                          lenpen=0.0, max_len_a=0.0, max_len_b=3)
        assert [h.tokens for h in hyps] == [[6, EOS_ID]]
    # the beams forced to end score better: they would come first
    assert table_logprob(only_six_first_table, (4, EOS_ID), [4, 4, 4, EOS_ID]) > \
        table_logprob(only_six_first_table, (4, EOS_ID), [6, EOS_ID])


def leaving_early_table(source: tuple[int, ...], prefix: tuple[int, ...]) -> torch.Tensor:
    """Source "4" ends after one word; source "5" says "5 5 6 EOS" (6 at its third step) unless 6 is banned."""
    if source == (4, EOS_ID):
        return scripted_table({}, default={EOS_ID: 0.95})(source, prefix)
    rules = {(): {5: 0.9}, (5,): {5: 0.9}, (5, 5): {6: 0.9}, (5, 5, 6): {EOS_ID: 0.9}}
    return scripted_table(rules, default={EOS_ID: 0.6})(source, prefix)


@both_search_paths
@pytest.mark.parametrize("stop", ["exact", "finished"])
def test_a_sentences_bans_hold_after_the_sentences_before_it_leave_the_batch(stop):
    """Sentence 0 is done after step 1 and leaves the batch; sentence 1 bans 6, which its model says
    at step 2: its bans move with it (not sentence 0's, which banned UNK, read in its place)."""
    decoder = ToyDecoder(leaving_early_table)
    controls = [SentenceControls(bans=[[UNK_ID]]), SentenceControls(bans=[[6]])]
    options = SearchOptions(beam=2, nbest=2, lenpen=0.0, max_len_b=6, stop=stop)
    batched = beam_search(decoder, sources([4], [5]), options, None, BatchControls.create(controls, CPU))
    alone = beam_search(ToyDecoder(leaving_early_table), sources([5]), options, None,
                        BatchControls.create(controls[1:], CPU))[0]
    assert [sentences for _, sentences in decoder.calls][:3] == [2, 2, 1]  # at step 2, sentence 1 alone
    assert not any(6 in h.tokens for h in batched[1]), [h.tokens for h in batched[1]]
    assert [(h.tokens, h.score) for h in batched[1]] == [(h.tokens, h.score) for h in alone]
    assert 6 in search(leaving_early_table, [5], beam=2, lenpen=0.0, max_len_b=6)[0].tokens  # the ban has work to do


def leaving_early_with_a_prefix_table(source: tuple[int, ...], prefix: tuple[int, ...]) -> torch.Tensor:
    """Source "4" ends after one word; source "5" says "5 5 5 5 EOS"."""
    if source == (4, EOS_ID):
        return scripted_table({}, default={EOS_ID: 0.95})(source, prefix)
    return scripted_table({}, default={5: 0.9} if len(prefix) < 4 else {EOS_ID: 0.9})(source, prefix)


@both_search_paths
def test_a_sentences_prefix_is_forced_whole_after_the_sentences_before_it_leave_the_batch():
    """Sentence 0 (no prefix) is done after step 1 and leaves the batch; sentence 1's prefix of four
    pieces is still forced at steps 2 and 3."""
    decoder = ToyDecoder(leaving_early_with_a_prefix_table)
    controls = [None, SentenceControls(prefix=[6, 6, 4, 4])]
    options = SearchOptions(beam=2, nbest=2, lenpen=0.0, max_len_b=8, stop="exact")
    batched = beam_search(decoder, sources([4], [5]), options, None, BatchControls.create(controls, CPU))
    assert [sentences for _, sentences in decoder.calls][:3] == [2, 2, 1]  # at step 2, sentence 1 alone
    assert all(h.tokens[:4] == [6, 6, 4, 4] for h in batched[1]), [h.tokens for h in batched[1]]
    alone = beam_search(ToyDecoder(leaving_early_with_a_prefix_table), sources([5]), options, None,
                        BatchControls.create(controls[1:], CPU))[0]
    assert [(h.tokens, h.score) for h in batched[1]] == [(h.tokens, h.score) for h in alone]


@both_search_paths
def test_banned_phrases_never_appear():
    repeats = scripted_table({}, default={4: 0.5, 5: 0.3, 6: 0.1, EOS_ID: 0.05})
    assert contains(search(repeats, [4], beam=2, max_len_b=6)[0].tokens, [4, 4])  # the ban has work to do
    bans = SentenceControls(bans=[[4, 4], [5, 5], [6]])
    for seed in range(6):
        for table in (repeats, random_table(seed, sharpness=2.0)):
            for hyp in controlled(table, [4, 5], bans, beam=3, nbest=3, max_len_b=6):
                assert not any(contains(hyp.tokens, ban) for ban in bans.bans), hyp.tokens


@both_search_paths
@pytest.mark.parametrize("sampling", [False, True])
def test_output_starts_with_exactly_the_prefix_whose_tokens_score_zero(sampling):
    prefix = [6, 6, UNK_ID]
    options = {"beam": 3, "nbest": 3, "max_len_b": 6, "sampling": sampling,
               "generator": torch.Generator().manual_seed(0)}
    for seed in range(3):
        table = random_table(seed)
        for hyp in controlled(table, [4, 5], SentenceControls(prefix=prefix), **options):
            assert hyp.tokens[:3] == prefix and hyp.positional_scores[:3] == [0.0] * 3
            key = (4, 5, EOS_ID)
            continuation = table_logprob(table, key, hyp.tokens) - table_logprob(table, key, prefix)
            assert sum(hyp.positional_scores) == pytest.approx(continuation, abs=1e-5)


@both_search_paths
def test_a_blocked_constraint_still_gives_a_translation_and_a_named_warning(messages):
    """A ban on the constraint's context can block it; the sentence ends at its max length without it."""
    table = scripted_table({}, default={4: 0.9, EOS_ID: 0.05})
    controls = SentenceControls(constraints=[[4, 5]], bans=[[5]])  # 5 can never be produced
    hyps = controlled(table, [4], controls, beam=2, max_len_b=4)
    assert hyps and not contains(hyps[0].tokens, [4, 5])
    warn_unmet([hyps], [controls], first_line=7)
    assert any("input line 7: its translation misses a constraint" in m for m in messages)


# --- the max length --------------------------------------------------------------------------------

def test_constraints_that_cannot_fit_are_left_out_with_a_warning_naming_the_sentence(messages):
    options = SearchOptions(max_len_a=0.0, max_len_b=3, stop="exact")
    sources_ = [torch.tensor([4, EOS_ID]).numpy()] * 3
    fits = SentenceControls(prefix=[4], constraints=[[5, 6]])
    inside_prefix = SentenceControls(prefix=[4, 5, 6], constraints=[[5, 6]])  # met by the prefix
    too_long = SentenceControls(prefix=[4], constraints=[[5, 6], [6]])
    checked = check_controls(sources_, [fits, inside_prefix, too_long], options, None, first_line=4)
    assert checked[:2] == [fits, inside_prefix]
    assert checked[2] == SentenceControls(prefix=[4])
    assert messages == [("input line 6: its constraints need 4 output pieces (with its prefix), over its max output "
                        "length 3: translated without them")]
    with pytest.raises(NmtError, match="input line 1: the prefix has 4 pieces, more than its max output length 3"):
        check_controls(sources_[:1], [SentenceControls(prefix=[4, 4, 4, 4])], options, None)
    with pytest.raises(NmtError, match="constraints need beam search"):
        check_controls(sources_[:1], [fits], SearchOptions(sampling=True), None)


# --- the text forms --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    from conftest import numbers_pairs

    return Vocabulary.train([side for pair in numbers_pairs(300, seed=1) for side in pair], vocab_size=120)


def test_the_tab_form_holds_the_prefix_then_the_constraints():
    assert split_line("a b\tc\td e", True, True, "x") == ("a b", "c", ["d e"])
    assert split_line("a b\t\td", True, True, "x") == ("a b", None, ["d"])
    assert split_line("a b\tc\td", False, True, "x") == ("a b", None, ["c", "d"])
    assert split_line("a b", False, True, "x") == ("a b", None, [])
    assert split_line("a b\tc", True, False, "x") == ("a b", "c", [])
    with pytest.raises(NmtError, match="input line 3 has no tab: with --prefix-column"):
        split_line("a b", True, False, "input line 3")
    with pytest.raises(NmtError, match="input line 3 has 3 tab-separated fields.*need --constraints"):
        split_line("a\tb\tc", True, False, "input line 3")


def test_controls_are_encoded_with_the_target_vocabulary(vocab):
    texts, controls = lines_with_controls(vocab, ["five\tfünf\tsieben", "six\t"], True, True, None,
                                          [vocab.encode("acht")])
    assert texts == ["five", "six"]
    assert controls[0] == SentenceControls(vocab.encode("fünf"), [vocab.encode("sieben")], [vocab.encode("acht")])
    assert controls[1] == SentenceControls(bans=[vocab.encode("acht")])
    assert lines_with_controls(vocab, ["five"], False, False, None, []) == (["five"], None)


def test_a_tab_without_a_tab_form_option_is_translated_as_text_with_a_warning(vocab, messages):
    lines = ["five", "six\tsechs", "seven\tsieben"]
    assert lines_with_controls(vocab, lines, False, False, None, []) == (lines, None)
    texts, _ = lines_with_controls(vocab, lines, False, False, None, [vocab.encode("acht")])  # --ban reads no tabs
    assert texts == lines
    assert warn_of_tabs(lines, tab_form=False, first_line=11)
    assert [m for m in messages if "tab" in m] == [
        "input line 12 holds a tab: translated as part of the source text (--prefix-column and --constraints read "
        "tab-separated fields)"]
    assert not warn_of_tabs(lines, tab_form=True) and not warn_of_tabs(["five"], tab_form=False)
    assert sum("holds a tab" in m for m in messages) == 1


@pytest.mark.parametrize("prefix,constraints,message", [
    (None, [""], "input line 2: constraint 1 is empty"),
    (None, ["sieben", "  "], "input line 2: constraint 2 is empty"),
    (None, ["ƒ"], "input line 2: constraint 1 'ƒ' has characters the target vocabulary cannot represent (ƒ)"),
    ("Zahl ƒ", [], "input line 2: the prefix 'Zahl ƒ' has characters"),
    (None, ["die acht Zahl"], "input line 2: constraint 1 'die acht Zahl' contains the banned phrase 'acht'"),
    ("acht", [], "input line 2: the prefix 'acht' contains the banned phrase 'acht'"),
])
def test_bad_controls_are_one_line_errors(vocab, prefix, constraints, message):
    with pytest.raises(NmtError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        sentence_controls(vocab, prefix, constraints, [vocab.encode("acht")], "input line 2")


@pytest.mark.parametrize("arguments,message", [
    ({"prefixes": "fünf"}, "prefixes must be a list of one string (or null) per sentence (2)"),
    ({"prefixes": ["fünf"]}, "prefixes must be a list"),
    ({"constraints": [["a"], "b"]}, "constraints must be a list of one list of strings (or null) per sentence"),
    ({"bans": "acht"}, "bans must be a list of strings"),
    ({"bans": ["acht", ""], "constraints": [None, ["acht"]]}, "input line 2: constraint 1 'acht' contains the banned"),
])
def test_lists_of_controls_are_checked(vocab, arguments, message):
    with pytest.raises(NmtError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        controls_from_lists(vocab, 2, **arguments)
    assert controls_from_lists(vocab, 2) is None


# --- through every surface: nmt generate, the API, the server, CTranslate2 -------------------------

SENTENCES = ["five", "Turn to page twelve.", "the number four", "seven", ""]
PREFIXES = ["die Zahl", "", "Schlag Seite", "sieben", "Zahl"]
CONSTRAINTS = [["fünf"], [], ["vier", "Seite"], ["acht"], ["neun"]]


@pytest.fixture(scope="module")
def model(tiny_data_dir, tmp_path_factory) -> Path:
    """transformer_tiny after 120 updates on the numbers task: words, not noise (a few seconds)."""
    return train_tiny_checkpoint(tiny_data_dir, tmp_path_factory.mktemp("controls"))


@pytest.fixture(scope="module")
def target(model) -> Vocabulary:
    return Translator.from_checkpoint(model, device="cpu").vocabs.target


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def tab_lines() -> list[str]:
    return ["\t".join([source, prefix, *constraints]) for source, prefix, constraints in
            zip(SENTENCES, PREFIXES, CONSTRAINTS)]


def cli_lines(monkeypatch, capsys, *args, stdin: str = "") -> list[str]:
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-q", *args, stdin=stdin)
    assert code == 0, err
    return out.splitlines()


def obeys(text: str, prefix: str, constraints: list[str]) -> bool:
    """The translation begins with the prefix and holds the constraints (as text: its pieces can
    encode differently on their own)."""
    return text.startswith(prefix) and all(c in text for c in constraints)


def pieces_of(lines: list[str]) -> list[list[str]]:
    """The pieces of each hypothesis of --format fairseq output."""
    return [line.split("\t")[2].split() for line in lines if line.startswith("H-")]


def test_the_tab_form_the_prefix_file_the_api_stdin_and_any_batching_agree(target, model, tmp_path, monkeypatch,
                                                                            capsys):
    tabs = write_lines(tmp_path / "tab.txt", tab_lines())
    found = cli_lines(monkeypatch, capsys, "-i", tabs, "--path", model, "--prefix-column", "--constraints")
    assert len(found) == len(SENTENCES)
    for text, prefix, constraints in zip(found, PREFIXES, CONSTRAINTS):
        assert obeys(text, prefix, constraints), text
    plain = cli_lines(monkeypatch, capsys, "-i", write_lines(tmp_path / "plain.txt", SENTENCES), "--path", model)
    assert sum(a != b for a, b in zip(found, plain)) >= 3  # the controls changed the translations

    prefixes = write_lines(tmp_path / "prefixes.txt", PREFIXES)
    constraint_lines = write_lines(tmp_path / "c.txt", ["\t".join([s, *c]) for s, c in zip(SENTENCES, CONSTRAINTS)])
    assert cli_lines(monkeypatch, capsys, "-i", constraint_lines, "--path", model, "--prefix", prefixes,
                     "--constraints") == found
    assert cli_lines(monkeypatch, capsys, "-i", tabs, "--path", model, "--prefix-column", "--constraints",
                     "--batch-size", "2", "--workers", "2") == found  # other batches, on two threads
    translator = Translator.from_checkpoint(model, device="cpu")
    assert translator.translate(SENTENCES, prefixes=PREFIXES, constraints=CONSTRAINTS) == found
    streamed = run_nmt("generate", "-i", "-", "--path", model, "--prefix-column", "--constraints", "-q",
                       stdin="".join(line + "\n" for line in tab_lines()))
    assert streamed.returncode == 0 and streamed.stdout.splitlines() == found, streamed.stderr


def test_banned_phrases_never_appear_in_generate(target, model, tmp_path, monkeypatch, capsys):
    options = ["-i", write_lines(tmp_path / "plain.txt", SENTENCES[:4]), "--path", model, "--nbest", "2", "--beam", "3",
               "--format", "fairseq"]
    plain = pieces_of(cli_lines(monkeypatch, capsys, *options))
    common = sorted({p for h in plain for p in h}, key=lambda p: -sum(h.count(p) for h in plain))
    words = [p[1:] for p in common if p.startswith("▁") and [target.piece(i) for i in target.encode(p[1:])] == [p]][:2]
    assert len(words) == 2 and all(any(f"▁{w}" in h for h in plain) for w in words)  # the bans have work to do
    banned = pieces_of(cli_lines(monkeypatch, capsys, *options, "--ban", write_lines(tmp_path / "bans.txt", words)))
    assert len(banned) == len(plain)
    assert not any(f"▁{w}" in h for h in banned for w in words), banned


def test_controls_with_an_ensemble_nbest_and_alignments(target, model, tmp_path, monkeypatch, capsys):
    other = tiny_checkpoint(tmp_path / "other.pt", target, seed=1)
    tabs = write_lines(tmp_path / "tab.txt", tab_lines())
    lines = cli_lines(monkeypatch, capsys, "-i", tabs, "--path", f"{model}:{other}", "--prefix-column", "--constraints",
                      "--nbest", "2", "--beam", "4", "--print-alignment", "--format", "fairseq")
    hypotheses = [line.split("\t") for line in lines if line.startswith("D-")]
    alignments = [line for line in lines if line.startswith("A-")]
    assert len(hypotheses) == len(alignments) == 2 * len(SENTENCES)
    for label, _, text in hypotheses:
        i = int(label[2:])
        assert obeys(text, PREFIXES[i], CONSTRAINTS[i]), text


def test_the_server_passes_the_controls_through(target, model, tmp_path_factory):
    from test_serve import request, run_server

    expected = Translator.from_checkpoint(model, device="cpu").translate(
        SENTENCES, prefixes=PREFIXES, constraints=CONSTRAINTS, bans=["hundert"])
    for address in run_server(model, tmp_path_factory):
        status, answer = request(address, "POST", "/translate", {"text": SENTENCES, "prefix": PREFIXES,
                                                                  "constraints": CONSTRAINTS, "ban": ["hundert"]})
        assert status == 200 and answer["translations"] == expected, answer
        for body, message in (({"text": ["five"], "prefix": "fünf"}, '"prefix" must be a list of one string'),
                              ({"text": ["five"], "constraints": [[""]]}, "text 1: constraint 1 is empty"),
                              ({"text": ["five"], "ban": [1]}, '"ban" must be a list of strings'),
                              ({"text": ["five"], "prefix": ["fünf " * 60]}, "text 1: the prefix has")):
            status, answer = request(address, "POST", "/translate", body)
            assert status == 422 and answer["error"].startswith(message), answer


@needs_ct2
def test_ctranslate2_takes_prefixes_and_bans_and_refuses_constraints(target, model, tmp_path, monkeypatch, capsys):
    tabs = write_lines(tmp_path / "tab.txt", [f"{s}\t{p}" for s, p in zip(SENTENCES, PREFIXES)])
    options = ["-i", tabs, "--path", model, "--prefix-column", "--lenpen", "0", "--beam", "3", "--format", "fairseq"]
    unbanned = pieces_of(cli_lines(monkeypatch, capsys, *options))
    words = [p[1:] for h in unbanned for p in h[len(target.encode(PREFIXES[0])):]
             if p.startswith("▁") and [target.piece(i) for i in target.encode(p[1:])] == [p]][:1]
    options += ["--ban", write_lines(tmp_path / "bans.txt", words)]
    ours = pieces_of(cli_lines(monkeypatch, capsys, *options))
    theirs = pieces_of(cli_lines(monkeypatch, capsys, *options, "--engine", "ctranslate2", "--lenpen-style", "fairseq"))
    assert words and ours != unbanned  # the ban has work to do
    assert theirs[:-1] == ours[:-1]
    zahl = [target.piece(i) for i in target.encode("Zahl")]
    # an empty source: CT2 gives the prefix alone
    assert theirs[-1] == zahl and ours[-1][:len(zahl)] == zahl != ours[-1]
    for hypothesis, prefix in zip(theirs, PREFIXES):
        assert hypothesis[:len(target.encode(prefix))] == [target.piece(i) for i in target.encode(prefix)]
        assert f"▁{words[0]}" not in hypothesis
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", tabs, "--path", model, "--constraints",
                             "--engine", "ctranslate2", "--lenpen-style", "fairseq")
    assert code == 1 and out == ""
    assert_one_line_error(err, "--engine ctranslate2 has no lexical constraints")
