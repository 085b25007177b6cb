"""Target prefixes, positive lexical constraints and banned phrases: each sentence's controls, and
their state while beam search runs (nmt/generation/search.py calls them through BatchControls).

- A prefix is forced: at step t a row of its sentence may only take the prefix's t-th piece, with
  log-probability 0, so the output begins with exactly those pieces and its score is the
  continuation's.
- A banned phrase is blocked at its last piece: that piece is banned wherever the pieces before it
  end the hypothesis (CTranslate2's suppress_sequences).
- Constraints (phrases the output must contain) use dynamic beam allocation (Post & Vilar 2018),
  vectorized across the batch as Hu et al. 2019: each hypothesis tracks, per constraint, how many
  of its pieces end the output so far, as a KMP automaton does (the longest prefix of the phrase
  that is a suffix of the output), so a constraint may start anywhere, and one the model abandons
  half-way falls back to whatever part of it still ends the output (the papers restart it from
  scratch, which misses "a a b" in "a a a b"). A hypothesis's bank is its progress: the pieces of
  the constraints it has met plus the longest partial match. Each step's candidates are the usual
  top 2*beam, each row's best token and each row's next constraint pieces; they are ranked bank by
  bank, taking the best of every bank before the second of any (highest bank first), so the most
  advanced hypotheses always keep a place in the beam and every step can advance one of them. EOS
  waits until all constraints are met; at the max length a hypothesis that has not met them may
  end only when no hypothesis of its sentence that has met them ever could.

Tokens are full-vocabulary ids; with a vocabulary shortlist, the search's log-probabilities have
one column per candidate of the row's sentence (``columns``), and the controls look tokens up there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from nmt.data.vocabulary import EOS_ID
from nmt.generation.search import NEG_INF


@dataclass(frozen=True)
class SentenceControls:
    """One sentence's controls, as full-vocabulary token ids (no BOS/EOS)."""

    prefix: list[int] = field(default_factory=list)
    constraints: list[list[int]] = field(default_factory=list)
    bans: list[list[int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefix or self.constraints or self.bans)

    def required_tokens(self) -> set[int]:
        """The pieces this sentence's vocabulary shortlist must keep: its prefix's and its constraints'."""
        return set(self.prefix) | {piece for phrase in self.constraints for piece in phrase}


def as_text(tokens: list[int]) -> str:
    """Token ids as one character each, so that Python's substring search (in C) finds phrases."""
    return "".join(map(chr, tokens))


def contains(tokens: list[int], phrase: list[int]) -> bool:
    """Whether ``phrase`` occurs in ``tokens`` as consecutive tokens (linear time: a request may hold many)."""
    return as_text(phrase) in as_text(tokens)


def transitions(phrase: list[int]) -> list[list[int]]:
    """``table[state][k]``: how many pieces of ``phrase`` end the output after ``phrase[k]`` follows
    an output that ended with ``state`` of them (its longest prefix that is a suffix of the output).
    A token that is no piece of the phrase always gives 0. Built as KMP's automaton, O(length^2):
    each state continues as the state its longest proper border is in would, except on its own next piece."""
    following: list[dict[int, int]] = [dict.fromkeys(phrase, 0)]  # per state: piece -> next state
    border = 0  # the state after the phrase's pieces 1..state-1: where a mismatch falls back to
    for state in range(len(phrase) + 1):
        if state:
            following.append(dict(following[border]))
            if state < len(phrase):
                border = following[border][phrase[state]]
        if state < len(phrase):
            following[state][phrase[state]] = state + 1
    return [[row[piece] for piece in phrase] for row in following]


def filled(phrases: list[list[list[int]]], device: torch.device, right: bool = False) -> Tensor:
    """Each sentence's phrases as one tensor (sentences, most phrases, longest phrase), padded with -1
    (phrases aligned to the left, or with ``right`` to the right)."""
    count = max((len(p) for p in phrases), default=0)
    longest = max((len(phrase) for p in phrases for phrase in p), default=0)
    out = torch.full((len(phrases), count, longest), -1, dtype=torch.long)
    for i, sentence in enumerate(phrases):
        for j, phrase in enumerate(sentence):
            if phrase:
                (out[i, j, longest - len(phrase):] if right else out[i, j, : len(phrase)]).copy_(torch.tensor(phrase))
    return out.to(device)


def advance(pieces: Tensor, table: Tensor, lengths: Tensor, matched: Tensor, met: Tensor, tokens: Tensor
            ) -> tuple[Tensor, Tensor]:
    """The constraint state after each row appends its token.

    ``pieces`` (rows, C, L) are each row's constraints (-1 padded), ``table`` (rows, C, L + 1, L)
    their ``transitions``, ``lengths`` (rows, C); ``matched`` (rows, C) the pieces of each
    constraint ending the output, ``met`` (rows, C) the constraints already seen; ``tokens`` (rows,).
    """
    hit = pieces == tokens[:, None, None]
    which = hit.to(torch.uint8).argmax(dim=2, keepdim=True)  # any piece equal to the token: same transition
    state = table.gather(2, matched[:, :, None, None].expand(-1, -1, 1, table.size(3))).squeeze(2)
    after = torch.where(hit.any(dim=2), state.gather(2, which).squeeze(2), torch.zeros_like(matched))
    met = met | (after == lengths)
    return after.masked_fill(met, 0), met


def progress(matched: Tensor, met: Tensor, lengths: Tensor) -> Tensor:
    """A hypothesis's bank: the pieces of its met constraints plus its longest partial match.
    Appending the next piece of that longest match always raises it by at least one."""
    return (lengths * met).sum(dim=-1) + matched.masked_fill(met, 0).amax(dim=-1)


def rank_in_bank(bank: Tensor, values: Tensor) -> Tensor:
    """Each candidate's place by score among its sentence's candidates of the same bank (0: the
    best); ``bank`` (sentences, candidates) is -1 for candidates left out."""
    by_score = values.sort(dim=1, descending=True, stable=True).indices
    order = by_score.gather(1, bank.gather(1, by_score).sort(dim=1, descending=True, stable=True).indices)
    grouped = bank.gather(1, order)
    position = torch.arange(grouped.size(1), device=bank.device).expand_as(grouped)
    first = torch.cat([torch.ones_like(grouped[:, :1], dtype=torch.bool), grouped[:, 1:] != grouped[:, :-1]], dim=1)
    rank = position - torch.where(first, position, 0).cummax(dim=1).values
    return torch.empty_like(rank).scatter_(1, order, rank)


class BatchControls:
    """The controls of a batch's sentences and the constraint state of its hypotheses.

    beam_search calls ``begin`` once, then each step ``restrict`` (after ``constrain``), ``select``
    (on ``select_top``'s candidates, when ``has_constraints``), ``keep`` (sentences that stay, when some
    are done) and ``reorder`` (the surviving rows and the token each appended).
    """

    def __init__(self, controls: list[SentenceControls | None], device: torch.device):
        controls = [c or SentenceControls() for c in controls]
        self.device = device
        self.prefix = filled([[c.prefix] for c in controls], device)[:, 0]  # (sentences, longest prefix)
        self.prefix_lengths = torch.tensor([len(c.prefix) for c in controls], dtype=torch.long, device=device)
        self.longest_prefix = self.prefix.size(1)

        self.pieces = filled([c.constraints for c in controls], device)  # (sentences, constraints, pieces)
        self.lengths = self.pieces.ge(0).sum(dim=2)
        self.has_constraints = self.pieces.size(1) > 0
        size = self.pieces.size(2)
        table = torch.zeros(*self.pieces.shape[:2], size + 1, size, dtype=torch.long)
        for i, c in enumerate(controls):
            for j, phrase in enumerate(c.constraints):
                table[i, j, : len(phrase) + 1, : len(phrase)] = torch.tensor(transitions(phrase))
        self.table = table.to(device)  # (sentences, constraints, states, pieces): see transitions()
        self.constrained = self.lengths.gt(0).any(dim=1)
        self.matched = torch.zeros_like(self.lengths)  # per row: beam search starts with one row a sentence
        self.met = self.lengths.eq(0)
        self.ended_with_all = torch.zeros(len(controls), dtype=torch.bool, device=device)

        bans = filled([c.bans for c in controls], device, right=True)  # (sentences, bans, pieces), right-aligned
        self.ban_context = bans[:, :, :-1]  # -1: any token (a shorter phrase) or no phrase
        self.ban_last = bans[:, :, -1] if bans.size(2) else bans.new_full(bans.shape[:2], -1)
        self.limit: Tensor | None = None
        self.columns: Tensor | None = None

    @classmethod
    def create(cls, controls: list[SentenceControls | None], device: torch.device) -> BatchControls | None:
        """The batch's controls; None when no sentence has any (the search then runs its plain path)."""
        return cls(controls, device) if any(controls) else None

    def begin(self, limit: Tensor, columns: Tensor | None = None) -> None:
        """The sentences' max output lengths, and the full-vocabulary id of each of a sentence's
        log-probability columns (sentences, width), ascending (None: column c is token c)."""
        self.limit, self.columns = limit, columns
        self.prefix_columns, self.piece_columns, self.ban_columns = (
            self.column(t) for t in (self.prefix, self.pieces, self.ban_last))

    def column(self, tokens: Tensor) -> Tensor:
        """The column of each token of each sentence (tokens: sentences, ...): -1 for -1, and for a
        token outside its sentence's shortlist."""
        if self.columns is None or tokens.numel() == 0:
            return tokens
        flat = tokens.reshape(len(tokens), -1)
        where = torch.searchsorted(self.columns, flat.clamp(min=0)).clamp(max=self.columns.size(1) - 1)
        found = (self.columns.gather(1, where) == flat) & (flat >= 0)
        return torch.where(found, where, -1).view_as(tokens)

    def token(self, columns: Tensor, sentences: Tensor) -> Tensor:
        """The full-vocabulary id of each column of the given (alive) sentences' rows."""
        return columns if self.columns is None else self.columns[sentences, columns]

    def sentence_of_rows(self, rows: int) -> Tensor:
        sentences = len(self.limit)
        return torch.arange(sentences, device=self.device).repeat_interleave(rows // sentences)

    def restrict(self, logprobs: Tensor, tokens: Tensor, step: int) -> None:
        """Ban in place what the controls forbid at this step; ``tokens`` (rows, step + 1) are the
        hypotheses so far, BOS first."""
        sentence = self.sentence_of_rows(logprobs.size(0))
        if self.ban_last.size(1):
            before = self.ban_context.size(2)
            recent = tokens[:, max(tokens.size(1) - before, 0):]
            recent = torch.nn.functional.pad(recent, (before - recent.size(1), 0), value=-2)  # matches no piece
            context = self.ban_context[sentence]
            hit = ((context == recent[:, None, :]) | (context < 0)).all(dim=2) & (self.ban_columns[sentence] >= 0)
            rows, which = hit.nonzero(as_tuple=True)
            logprobs[rows, self.ban_columns[sentence[rows], which]] = NEG_INF
        if self.has_constraints:
            waiting = ~self.met.all(dim=1) & (self.limit[sentence] > step)
            logprobs[:, EOS_ID].masked_fill_(waiting, NEG_INF)  # a special token's column is its id
        if step < self.longest_prefix:
            rows = ((self.prefix_lengths[sentence] > step) & (self.limit[sentence] > step)).nonzero(as_tuple=True)[0]
            logprobs[rows] = NEG_INF
            logprobs[rows, self.prefix_columns[sentence[rows], step]] = 0.0

    def select(self, top: tuple[Tensor, Tensor, Tensor], scores: Tensor, logprobs: Tensor, beam: int
               ) -> tuple[Tensor, Tensor, Tensor]:
        """Beam search's candidates with constraints: like ``top`` (the backend's select_top: 2*beam
        per sentence, (score, beam, column)), in dynamic beam allocation's order; sentences without
        constraints get exactly ``top``."""
        sentences, width = scores.shape
        vocab = logprobs.size(1)
        slots = self.lengths.size(1)
        sentence = self.sentence_of_rows(sentences * width)

        # Extra candidates of the constrained sentences: each row's best token and its constraints' next pieces.
        nexts = self.piece_columns[sentence].gather(2, self.matched[:, :, None]).squeeze(2).masked_fill(self.met, -1)
        extra_columns = torch.cat([logprobs.argmax(dim=1, keepdim=True), nexts], dim=1).view(sentences, -1)
        extra_beams = torch.arange(width, device=self.device).repeat_interleave(slots + 1).expand(sentences, -1)
        extra_rows = extra_beams + (torch.arange(sentences, device=self.device) * width)[:, None]
        extra_scores = scores.view(-1)[extra_rows] + logprobs[extra_rows, extra_columns.clamp(min=0)]
        extra_scores = extra_scores.masked_fill((extra_columns < 0) | ~self.constrained[:, None], NEG_INF)
        values = torch.cat([top[0], extra_scores], dim=1)
        beams = torch.cat([top[1], extra_beams], dim=1)
        columns = torch.cat([top[2], extra_columns.clamp(min=0)], dim=1)

        # The same (beam, column) twice counts once.
        keys, order = (beams * vocab + columns).sort(dim=1, stable=True)
        values, beams, columns = values.gather(1, order), beams.gather(1, order), columns.gather(1, order)
        values[:, 1:].masked_fill_(keys[:, 1:] == keys[:, :-1], NEG_INF)

        rows = (beams + (torch.arange(sentences, device=self.device) * width)[:, None]).view(-1)
        owner = rows // width
        matched, met = advance(self.pieces[owner], self.table[owner], self.lengths[owner], self.matched[rows],
                               self.met[rows], self.token(columns.view(-1), owner))
        bank = progress(matched, met, self.lengths[owner]).view(sentences, -1)
        done = met.all(dim=1).view(sentences, -1)
        alive = torch.isfinite(values)
        ends = columns.eq(EOS_ID) & alive
        # An end without all constraints (only possible at the max length) only where its sentence has no other.
        has_ending = (ends & done).any(dim=1) | self.ended_with_all
        values = values.masked_fill(ends & ~done & has_ending[:, None], NEG_INF)
        alive = torch.isfinite(values)

        # An end among the `beam` best candidates of its bank finishes (in the first `beam` places, as
        # select_top's do). The others stay by dynamic beam allocation: the best of each bank (highest
        # bank first), then the second of each, and so on.
        bank = bank.masked_fill(~alive, -1)
        finishing = ends & (rank_in_bank(bank, values) < beam)
        values = values.masked_fill(ends & ~finishing, NEG_INF)
        staying = bank.masked_fill(ends, -1)
        most = int(self.lengths.sum(dim=1).max()) + 1  # above every bank
        key = torch.where(staying >= 0, rank_in_bank(staying, values) * (most + 1) + (most - staying),
                          torch.iinfo(torch.long).max).masked_fill(finishing, -1)
        chosen = key.sort(dim=1, stable=True).indices[:, : 2 * beam]

        self.ended_with_all |= (finishing & done).any(dim=1)  # at most `beam` of them: all in the first places
        found = values.gather(1, chosen), beams.gather(1, chosen), columns.gather(1, chosen)
        mine = self.constrained[:, None]
        return tuple(torch.where(mine, ours, theirs) for ours, theirs in zip(found, top))

    def keep(self, still: Tensor) -> None:
        """Only the sentences ``still`` stay (the rows follow in ``reorder``)."""
        for name in ("prefix", "prefix_columns", "prefix_lengths", "pieces", "piece_columns", "lengths", "table",
                     "constrained", "ended_with_all", "ban_context", "ban_last", "ban_columns", "limit"):
            setattr(self, name, getattr(self, name)[still])
        if self.columns is not None:
            self.columns = self.columns[still]

    def reorder(self, rows: Tensor, tokens: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` with ``tokens[i]`` (a full-vocabulary id) appended."""
        if not self.has_constraints:
            return
        sentence = self.sentence_of_rows(len(rows))
        self.matched, self.met = advance(self.pieces[sentence], self.table[sentence], self.lengths[sentence],
                                         self.matched[rows], self.met[rows], tokens)
