"""Controls as users give them: target prefixes, constraints and banned phrases as text, encoded
with the target sentencepiece model into SentenceControls, and checked.

Raw text input (``-i FILE`` or stdin) has one form, tab-separated: the source; then, with
``--prefix-column``, a tab and the target prefix (empty: none); then, with ``--constraints``, a
tab before each constraint (fairseq's form)::

    A man rides a bike.<TAB>Ein Mann<TAB>Fahrrad          (--prefix-column --constraints)

``--prefix FILE`` gives the prefixes as a file of their own instead, one line per input line (also
for a binarized split); ``--ban FILE`` one banned phrase a line, for every sentence.
"""

from __future__ import annotations

from typing import Callable

from nmt.data.vocabulary import UNK_ID, Vocabulary
from nmt.errors import NmtError
from nmt.files import read_lines
from nmt.generation.constraints import SentenceControls, as_text
from nmt.generation.search import SearchStopped
from nmt.log import logger


def split_line(line: str, prefix_column: bool, constraints: bool, where: str) -> tuple[str, str | None, list[str]]:
    """The source, prefix (None: none) and constraints of one input line in the tab form."""
    fields = line.split("\t")
    source = fields.pop(0)
    prefix = None
    if prefix_column:
        if not fields:
            raise NmtError(f"{where} has no tab: with --prefix-column each line is source<TAB>prefix "
                           "(the prefix may be empty)")
        prefix = fields.pop(0) or None
    if fields and not constraints:
        raise NmtError(f"{where} has {line.count(chr(9)) + 1} tab-separated fields, but is source<TAB>prefix "
                       "(constraints after more tabs need --constraints)")
    return source, prefix, fields


def encode_phrase(vocab: Vocabulary, text: str, what: str, most_pieces: int | None = None) -> list[int]:
    """A phrase's target pieces; empty text, text the vocabulary cannot represent, or more than
    ``most_pieces`` pieces (None: any number) is an error."""
    if not text.strip():
        raise NmtError(f"{what} is empty")
    ids = vocab.encode(text)
    if UNK_ID in ids:
        unknown = sorted({c for c in text if UNK_ID in vocab.encode(c)})
        raise NmtError(f"{what} {text[:40]!r} has characters the target vocabulary cannot represent "
                       f"({' '.join(unknown[:10]) or 'unknown pieces'})")
    if most_pieces is not None and len(ids) > most_pieces:
        raise NmtError(f"{what} {text[:40]!r} has {len(ids)} pieces; at most {most_pieces} a phrase")
    return ids


def encode_bans(vocab: Vocabulary, phrases: list[str], what: str, most_pieces: int | None = None) -> list[list[int]]:
    """Banned phrases, blank ones left out; errors name phrase n as ``what`` n ("bans.txt line")."""
    return [encode_phrase(vocab, text, f"{what} {number}", most_pieces) for number, text in enumerate(phrases, start=1)
            if text.strip()]


def read_bans(vocab: Vocabulary, path: str) -> list[list[int]]:
    return encode_bans(vocab, read_lines(path), f"{path} line")


def sentence_controls(vocab: Vocabulary, prefix: str | None, constraints: list[str], bans: list[list[int]],
                      where: str, most_pieces: int | None = None) -> SentenceControls | None:
    """One sentence's controls (None when it has none); constraints hold at most ``most_pieces``
    pieces each (None: any number). A prefix or constraint holding a banned phrase is an error: the
    output could not both contain and avoid it. Linear in the phrases' pieces (see ``contains``)."""
    pieces = encode_phrase(vocab, prefix, f"{where}: the prefix") if prefix else []
    phrases: dict[tuple[int, ...], None] = {}  # in order, each once
    for number, text in enumerate(constraints, start=1):
        phrases.setdefault(tuple(encode_phrase(vocab, text, f"{where}: constraint {number}", most_pieces)))
    banned = [(ban, as_text(ban)) for ban in bans]
    for what, phrase in [("the prefix", pieces)] + [(f"constraint {i}", list(p)) for i, p in enumerate(phrases, 1)]:
        text = as_text(phrase)
        for ban, ban_text in banned:
            if ban_text in text:
                raise NmtError(f"{where}: {what} {vocab.decode(phrase)[:40]!r} contains the banned phrase "
                               f"{vocab.decode(ban)!r}")
    controls = SentenceControls(pieces, [list(p) for p in phrases], bans)
    return controls or None


def controls_from_lists(vocab: Vocabulary, count: int, prefixes: object = None, constraints: object = None,
                        bans: object = None, names: tuple[str, str, str] = ("prefixes", "constraints", "bans"),
                        most_pieces: int | None = None, should_stop: Callable[[], bool] | None = None
                        ) -> list[SentenceControls | None] | None:
    """The controls of ``count`` sentences given as Python lists (the API's and the server's form):
    one prefix (a string or None) and one list of constraint strings per sentence, and banned
    phrases for all of them. None when none is given. ``names`` name the three in errors; a ban or
    constraint may hold at most ``most_pieces`` pieces (None: any number). ``should_stop`` is
    asked before each sentence (the server: has the client gone?); True raises SearchStopped."""
    if prefixes is None and constraints is None and not bans:
        return None
    prefix_name, constraints_name, bans_name = names
    if prefixes is not None and not (isinstance(prefixes, list) and len(prefixes) == count and
                                     all(p is None or isinstance(p, str) for p in prefixes)):
        raise NmtError(f"{prefix_name} must be a list of one string (or null) per sentence ({count})")
    if constraints is not None and not (isinstance(constraints, list) and len(constraints) == count and all(
            c is None or (isinstance(c, list) and all(isinstance(t, str) for t in c)) for c in constraints)):
        raise NmtError(f"{constraints_name} must be a list of one list of strings (or null) per sentence ({count})")
    if bans is not None and not (isinstance(bans, list) and all(isinstance(b, str) for b in bans)):
        raise NmtError(f"{bans_name} must be a list of strings")
    banned = encode_bans(vocab, bans or [], f"{bans_name} phrase", most_pieces)
    controls = []
    for i in range(count):
        if should_stop is not None and should_stop():
            raise SearchStopped(f"stopped at sentence {i + 1} of {count}")
        controls.append(sentence_controls(vocab, prefixes[i] if prefixes else None,
                                          (constraints[i] or []) if constraints else [], banned, f"input line {i + 1}",
                                          most_pieces))
    return controls


def warn_of_tabs(lines: list[str], tab_form: bool, first_line: int = 1) -> bool:
    """A tab is source text unless an option reads the tab form (``tab_form``); a line that holds one
    was more likely meant for --prefix-column or --constraints, so say so, naming the first such
    line. Returns whether it warned (a stream warns once)."""
    number = None if tab_form else next((n for n, line in enumerate(lines, start=first_line) if "\t" in line), None)
    if number is not None:
        logger.warning("input line %d holds a tab: translated as part of the source text (--prefix-column and "
                       "--constraints read tab-separated fields)", number)
    return number is not None


def lines_with_controls(vocab: Vocabulary, lines: list[str], prefix_column: bool, constraints: bool,
                        prefixes: list[str] | None, bans: list[list[int]], first_line: int = 1
                        ) -> tuple[list[str], list[SentenceControls | None] | None]:
    """The source text of input lines and their controls (None when no control is asked for):
    the tab form (``split_line``), ``prefixes`` from --prefix FILE (one per line), ``bans`` for all."""
    if not (prefix_column or constraints or prefixes is not None or bans):
        return lines, None
    sources, controls = [], []
    for number, line in enumerate(lines, start=first_line):
        where = f"input line {number}"
        source, prefix, phrases = split_line(line, prefix_column, constraints, where) \
            if prefix_column or constraints else (line, None, [])
        if prefixes is not None:
            prefix = prefixes[number - first_line] or None
        sources.append(source)
        controls.append(sentence_controls(vocab, prefix, phrases, bans, where))
    return sources, controls
