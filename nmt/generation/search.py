"""Beam search, greedy decoding and sampling as one loop over small, separately tested steps.

Each step: the decoder scores the next token of every alive hypothesis (``beam`` rows per
sentence; beam search starts from one row, as all its beams would begin identical);
``constrain`` bans tokens (min/max length, repeated n-grams); ``select`` proposes ``2 * beam``
candidates per sentence for beam search (its top-k), one random draw per line for sampling; the
candidates that end in EOS among the first ``beam`` are finished, scored with the length
penalty; the first ``beam`` others stay alive (a sampled line that ended stays dead). A sentence
is done once it has ``beam`` finished hypotheses and no alive one can still beat the worst of
them; done sentences leave the batch, and the decoder cache is reordered to follow the
surviving beams. The encoder output keeps one row per sentence, which its beams share.

The log-softmax and the top-k are the model's backend's (nmt/backends/torch_backend.py), as are
its attention and its cache: the search is the same loop whatever computes them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID
from nmt.errors import NmtError
from nmt.generation.candidates import Candidates
from nmt.generation.options import SearchOptions
from nmt.generation.searchable import SearchableModel, SearchControls

NEG_INF = float("-inf")
HYPOTHESIS_BYTES_PER_TOKEN = 12 * 2 + 80  # token id and score tensors (two copies while they grow), Python lists


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS, ending in EOS
    score: float  # length-normalized log-probability
    positional_scores: list[float] = field(default_factory=list)  # log-probability of each token


def length_penalty(lengths: Tensor, alpha: float, style: str = "gnmt") -> Tensor:
    """GNMT's ((5 + |Y|) / 6)^alpha (the paper's, via Wu et al. 2016), or fairseq's |Y|^alpha.

    |Y| counts the output tokens including the final EOS.
    """
    lengths = lengths.to(torch.float32)
    if style == "gnmt":
        return ((5.0 + lengths) / 6.0) ** alpha
    if style == "fairseq":
        return lengths ** alpha
    raise ValueError(f"unknown length penalty style {style!r}")


@functools.lru_cache(maxsize=4096)
def final_penalty(length: int, alpha: float, style: str) -> float:
    """length_penalty of one length, as a Python number: finalize's at each step, computed once per length
    (a few tensor operations, at most of the steps of every batch)."""
    return float(length_penalty(torch.tensor(length), alpha, style))


def max_lengths(source_lengths: Tensor, a: float, b: int, max_positions: int | None = None) -> Tensor:
    """Most output tokens (EOS excluded) per sentence: a * |source| + b, |source| without EOS, and
    at most ``max_positions - 1``: the decoder reads BOS and the tokens before EOS (fairseq's cap)."""
    most = float(max_positions - 1) if max_positions is not None else float(torch.iinfo(torch.int32).max)
    return (a * source_lengths.to(torch.float64) + float(b)).floor().clamp(min=1, max=max(1.0, most)).to(torch.long)


def model_positions(model: SearchableModel) -> int | None:
    """The longest sequence a model takes (for an ensemble, its shortest model's); None when it does not say."""
    limits = [m.config.max_positions for m in getattr(model, "models", [model])
              if hasattr(getattr(m, "config", None), "max_positions")]
    return min(limits, default=None)


def constrain(logprobs: Tensor, tokens: Tensor, step: int, max_len: Tensor, min_len: int,
              no_repeat_ngram_size: int, columns: Tensor | None = None, owner: Tensor | None = None) -> Tensor:
    """Ban tokens in place: specials never; EOS before min_len; only EOS at max_len; n-gram repeats.

    ``tokens`` (rows, step + 1) is each hypothesis so far, BOS first; ``max_len`` is per row.
    With ``columns`` (a shortlist: sentences, width, each sentence's vocabulary ids, ascending) and
    ``owner`` (each row's sentence), ``logprobs`` has a column per entry of its row's sentence (a
    special token's column is its id).
    """
    logprobs[:, PAD_ID] = NEG_INF
    logprobs[:, BOS_ID] = NEG_INF
    if step < min_len:
        logprobs[:, EOS_ID] = NEG_INF
    at_limit = max_len <= step
    if at_limit.any():
        eos = logprobs[at_limit, EOS_ID].clone()
        logprobs[at_limit] = NEG_INF
        logprobs[at_limit, EOS_ID] = torch.where(torch.isfinite(eos), eos, torch.zeros_like(eos))
    n = no_repeat_ngram_size
    generated = tokens[:, 1:]
    if n > 0 and generated.size(1) >= n:
        windows = generated.unfold(1, n, 1)  # (rows, count, n): every n-gram so far
        prefix = generated[:, generated.size(1) - n + 1:]  # the n-1 last tokens
        matches = (windows[:, :, :-1] == prefix[:, None, :]).all(dim=2) if n > 1 else \
            torch.ones(windows.shape[:2], dtype=torch.bool, device=tokens.device)
        rows, where = matches.nonzero(as_tuple=True)
        lasts = windows[:, :, -1]  # (rows, count): the token each n-gram ends with
        if columns is not None and len(rows):
            lasts = torch.searchsorted(columns[owner], lasts.contiguous())  # its column in its row's sentence
        logprobs[rows, lasts[rows, where]] = NEG_INF
    return logprobs


def select_sample(scores: Tensor, logprobs: Tensor, temperature: float, topk: int, topp: float,
                  generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Sampling: one draw per row, so each of the ``beam`` samples is an independent line.

    ``scores`` (sentences, rows per sentence) and ``logprobs`` (rows, vocab) as in select_top. A
    line that draws EOS is finished and its row stays dead (score -inf) until the sentence is
    done: refilling it from another line would duplicate that line's prefix and favour short samples.
    """
    sentences, rows_per = scores.shape
    # From the row's best: a tiny temperature makes it 0 and the others -inf (greedy), never all -inf (nan).
    weights = ((logprobs - logprobs.amax(dim=-1, keepdim=True)) / temperature).softmax(dim=-1)
    if topk > 0:
        kth = weights.topk(min(topk, weights.size(1)), dim=-1).values[:, -1:]
        weights = weights.masked_fill(weights < kth, 0.0)
    if topp > 0.0:
        sorted_weights, order = weights.sort(dim=-1, descending=True)
        outside = sorted_weights.cumsum(dim=-1) - sorted_weights > topp  # keep the smallest set reaching topp
        weights = weights.scatter(1, order, sorted_weights.masked_fill(outside, 0.0))
    alive = weights.sum(dim=-1) > 0
    weights[~alive, EOS_ID] = 1.0  # a row with nothing allowed (cannot happen after constrain) ends
    draws = torch.multinomial(weights, 1, generator=generator)
    beams = torch.arange(rows_per, device=scores.device).expand(sentences, -1)
    return scores + logprobs.gather(1, draws).view(sentences, rows_per), beams, draws.view(sentences, rows_per)


def row_bytes(positions: int, columns: int, models: int = 1) -> int:
    """The most one row (a hypothesis) of ``positions`` steps takes in the search's own tensors, scoring
    ``columns`` (the vocabulary, or a shortlist's) with ``models`` (an ensemble's): its tokens and
    scores so far and its finished hypotheses, and one step's float32 logits and log-probabilities
    (an ensemble's per model, stacked, and their mean). The server sizes its batches with it."""
    return positions * HYPOTHESIS_BYTES_PER_TOKEN + (2 * models + 3) * columns * 4


class SearchStopped(Exception):
    """``should_stop`` said the result is no longer wanted (the server: every request of the batch has gone)."""


def beam_search(model: SearchableModel, source: Tensor, options: SearchOptions,
                generator: torch.Generator | None = None, controls: SearchControls | None = None,
                should_stop: Callable[[], bool] | None = None,
                candidates: Candidates | None = None) -> list[list[Hypothesis]]:
    """Decode a padded batch of sources; returns the ``nbest`` hypotheses per sentence, best first.

    ``controls`` (nmt/generation/constraints.py) force prefixes, ban phrases and place constraints.
    ``should_stop`` is asked before each step; when it answers True the search raises SearchStopped.
    With ``candidates`` (a vocabulary shortlist), the model scores only each sentence's own: the
    steps work in column space (column c of a sentence's rows is token ``columns[sentence, c]``)
    and tokens are mapped back to vocabulary ids as they join a hypothesis.

    ``options.stop`` must be exact, current or finished: ``auto`` is for the caller to resolve from the
    checkpoint's record (nmt.generation.decoding_settings.stop_for) before searching."""
    if options.stop == "auto":
        raise ValueError("stop='auto' reached the search: resolve it first (decoding_settings.stop_for)")
    beam = options.beam
    device = source.device
    sentences = source.size(0)
    source_lengths = source.ne(PAD_ID).sum(dim=1) - 1  # EOS excluded
    limit = max_lengths(source_lengths, options.max_len_a, options.max_len_b, model_positions(model))

    # Beam search starts from one row per sentence (its beams would all be the same prefix, BOS)
    # and widens to `beam` rows after the first step; sampling draws `beam` lines from the start.
    width = beam if options.sampling else 1  # rows per sentence now
    columns = candidates.columns if candidates is not None else None
    padding = candidates.padding if candidates is not None else None  # each sentence's repeated last columns
    # One row per sentence, shared by its `width` decoder rows.
    encoder_out = model.encode(source) if columns is None else model.encode(source, columns)
    cache = model.new_cache()
    cache.reserve(int(limit.max()) + 1, sentences * beam)  # room for the longest output at once

    tokens = torch.full((sentences * width, 1), BOS_ID, dtype=torch.long, device=device)
    token_scores = torch.zeros((sentences * width, 0), device=device)
    scores = torch.zeros(sentences, width, device=device)
    alive_ids = torch.arange(sentences, device=device)  # original index of each alive sentence
    finished: list[list[Hypothesis]] = [[] for _ in range(sentences)]
    worst = torch.full((sentences,), NEG_INF, dtype=torch.float64, device=device)  # see finalize
    if controls is not None:
        controls.begin(limit, columns)
    rows_changed = True  # owner, row_limit and base are made again when the rows or their sentences change
    longest_penalty = longest_penalties(limit, options)  # is_done's, the same at every step
    positions: Tensor | None = None  # 0, 1, ... for each sentence's candidates

    for step in range(int(limit.max()) + 1):
        if should_stop is not None and should_stop():
            raise SearchStopped(f"stopped at step {step}")
        logits = model.decode(tokens[:, -1:], encoder_out, cache)[:, -1].float()
        if rows_changed:  # what depends on the rows' sentences only, made again only when they change
            owner = alive_ids.repeat_interleave(width)  # each row's sentence
            row_limit = limit[owner]
            base = (torch.arange(len(alive_ids), device=device) * width).unsqueeze(1)  # each sentence's first row
            rows_changed = False
        logprobs = constrain(model.backend.log_softmax_(logits, padding, alive_ids),  # in place: one tensor less
                             tokens, step, row_limit, options.min_len, options.no_repeat_ngram_size, columns, owner)
        if controls is not None:
            controls.restrict(logprobs, tokens, step)
        if options.sampling:
            cand_scores, cand_beams, cand_tokens = select_sample(
                scores, logprobs, options.temperature, options.topk, options.topp, generator)
        else:
            top = model.backend.select_top(scores, logprobs, beam)
            constrained = controls is not None and controls.has_constraints
            cand_scores, cand_beams, cand_tokens = controls.select(top, scores, logprobs, beam) if constrained else top
        cand_rows = base + cand_beams  # (alive sentences, 2*beam) rows the candidates extend

        # Finish the EOS candidates among the first `beam`; keep the first `beam` others alive
        # (sampling has exactly `beam` candidates: a finished line's row stays, dead at -inf).
        finite = torch.isfinite(cand_scores)
        is_eos = cand_tokens.eq(EOS_ID) & finite
        finalize(finished, worst, alive_ids, is_eos[:, :beam], cand_scores, cand_rows, tokens, token_scores,
                 logprobs, step, options)
        if positions is None or len(positions) != cand_scores.size(1):
            positions = torch.arange(cand_scores.size(1), device=device)
        rank = torch.where(is_eos | ~finite, 2 * beam, 0) + positions
        keep = rank.topk(beam, dim=1, largest=False).indices.sort(dim=1).values
        keep_rows = cand_rows.gather(1, keep)
        keep_tokens = cand_tokens.gather(1, keep)
        scores = cand_scores.gather(1, keep).masked_fill(rank.gather(1, keep) >= 2 * beam, NEG_INF)

        done = is_done(worst, alive_ids, scores, limit, step, options, longest_penalty)
        leaving = int(done.sum())  # one look at the tensor, not two (all, any)
        if leaving == len(done):
            break
        if leaving:  # done sentences leave the batch
            still = (~done).nonzero(as_tuple=True)[0]
            keep_rows, keep_tokens, scores = keep_rows[still], keep_tokens[still], scores[still]
            alive_ids = alive_ids[still]
            rows_changed = True
            encoder_out = model.reorder_encoder_out(encoder_out, still)
            if controls is not None:
                controls.keep(still)
        order = keep_rows.reshape(-1)
        step_scores = logprobs[order, keep_tokens.reshape(-1)]
        new_tokens = keep_tokens if columns is None else columns[alive_ids[:, None], keep_tokens]  # vocabulary ids
        tokens = torch.cat([tokens[order], new_tokens.reshape(-1, 1)], dim=1)
        token_scores = torch.cat([token_scores[order], step_scores.unsqueeze(1)], dim=1)
        cache.reorder(order)
        if controls is not None:
            controls.reorder(order, tokens[:, -1])  # the vocabulary ids just appended
        rows_changed = rows_changed or width != beam
        width = beam

    if not all(finished):  # only non-finite scores end a sentence with nothing: an EOS is forced at the limit
        raise NmtError(f"the model gave no finite score to any translation of {finished.count([])} sentence(s) "
                       "(nan or inf: with --precision fp16, an overflow); try --precision bf16 or fp32")
    return [sorted(hyps, key=lambda h: -h.score)[: options.nbest] for hyps in finished]


def finalize(finished: list[list[Hypothesis]], worst: Tensor, alive_ids: Tensor, eos: Tensor, cand_scores: Tensor,
             cand_rows: Tensor, tokens: Tensor, token_scores: Tensor, logprobs: Tensor, step: int,
             options: SearchOptions) -> None:
    """Record the hypotheses that just produced EOS, with their length-normalized scores, and set
    ``worst`` (per sentence) to the score of its ``beam``-th best (-inf while it has fewer).

    What they need is copied to the CPU in one go (one device sync per step, not one per hypothesis).
    """
    if not eos.any():
        return
    penalty = final_penalty(step + 1, options.lenpen, options.lenpen_style)
    sentences, slots = eos.nonzero(as_tuple=True)
    rows = cand_rows[sentences, slots]
    owners = alive_ids[sentences].tolist()
    scores = (cand_scores[sentences, slots].float() / penalty).tolist()
    prefixes, prefix_scores = tokens[rows, 1:].tolist(), token_scores[rows].tolist()
    eos_scores = logprobs[rows, EOS_ID].tolist()
    new_worst: dict[int, float] = {}
    for owner, score, prefix, prefix_score, eos_score in zip(owners, scores, prefixes, prefix_scores, eos_scores):
        hyps = finished[owner]
        if len(hyps) >= options.beam and not score > hyps[-1].score:
            continue
        hyps.append(Hypothesis(prefix + [EOS_ID], score, prefix_score + [eos_score]))
        hyps.sort(key=lambda h: -h.score)
        del hyps[options.beam:]
        if len(hyps) == options.beam:
            new_worst[owner] = hyps[-1].score
    if new_worst:
        worst[list(new_worst)] = torch.tensor(list(new_worst.values()), dtype=worst.dtype, device=worst.device)


def longest_penalties(limit: Tensor, options: SearchOptions) -> Tensor:
    """Each sentence's length penalty at its longest output (``limit + 1``), in float64: the bound of
    is_done for a length penalty >= 0."""
    return length_penalty(limit + 1, options.lenpen, options.lenpen_style).double()


def is_done(worst: Tensor, alive_ids: Tensor, alive_scores: Tensor, limit: Tensor, step: int,
            options: SearchOptions, longest_penalty: Tensor | None = None) -> Tensor:
    """A sentence is done when it has ``beam`` finished hypotheses that no alive one can beat
    (``worst``: see finalize).

    Log-probabilities only fall as a hypothesis grows, and the penalty grows with length, so an
    alive hypothesis's best reachable score is its current score divided by the penalty at the
    longest length it may still reach (or at the next step when alpha < 0). With a positive alpha
    that bound stays loose for long: ``stop="current"`` divides by the penalty at the next step
    instead (the score the hypothesis would have if it ended there), and ``stop="finished"`` ends
    the sentence as soon as ``beam`` hypotheses have finished. Sampling stops at ``beam``
    samples; every search stops at the max length or when no hypothesis is left alive. Tensor
    operations only, on the search's device: no copy to the host. ``longest_penalty``: longest_penalties,
    which beam_search works out once per batch rather than at every step (None: here).
    """
    best_alive = alive_scores.max(dim=1).values.double()
    limits = limit[alive_ids]
    alive_worst = worst[alive_ids]
    full = torch.isfinite(alive_worst)
    if options.sampling or options.stop == "finished":
        beaten = full
    else:
        if options.lenpen >= 0 and options.stop == "exact":
            penalty = (longest_penalties(limit, options) if longest_penalty is None else longest_penalty)[alive_ids]
        else:
            penalty = length_penalty(torch.full_like(limits, step + 2), options.lenpen, options.lenpen_style).double()
        bound = best_alive / penalty
        beaten = full & (bound <= alive_worst)
    return ~torch.isfinite(best_alive) | (limits <= step) | beaten
