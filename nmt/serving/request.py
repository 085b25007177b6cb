"""A /translate request: its body read into sentences, search options and controls, each checked
against the server's limits before the work that grows with it.

``parse_request`` takes the JSON apart and refuses, from their counts and lengths alone, what is
over a limit: sentences, characters (the text's and the controls' together), banned phrases,
constraints per sentence. ``prepare`` then encodes what is left (a thread's work: the server runs
it off its event loop) and checks what needs the pieces: a phrase's pieces, a prefix within its
sentence's max output length, a source within the model's positions, each output within
--max-output-length.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from nmt.errors import NmtError
from nmt.generation.constraints import SentenceControls
from nmt.generation.control_input import controls_from_lists
from nmt.generation.inference import check_controls, check_lengths, encode_sources
from nmt.generation.options import SearchOptions
from nmt.generation.search import max_lengths, model_positions
from nmt.generation.translator import Translator
from nmt.options import flag
from nmt.serving.options import ServeOptions

MAX_LEN_A = 4.0  # with --max-output-length, what keeps a request from making the server decode for ever
# JSON may escape every character as \uXXXX, twice for one outside the BMP: 12 bytes a character
BODY_BYTES_PER_CHARACTER, BODY_SLACK = 12, 65536
# What a request may set: the deterministic search options (sampling would depend on the batch).
REQUEST_OPTIONS = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "min_len", "no_repeat_ngram_size",
                   "nbest", "stop", "shortlist")
CONTROL_FIELDS = ("prefix", "constraints", "ban")  # passed to controls_from_lists


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Prepared:
    """A request ready for the batcher."""

    sources: list[np.ndarray]  # token ids ending in EOS
    search: SearchOptions
    controls: list[SentenceControls | None] | None
    output_limits: list[int]  # the longest output each source may reach


def body_limit(options: ServeOptions) -> int:
    return options.max_characters * BODY_BYTES_PER_CHARACTER + BODY_SLACK


def parse_request(body: bytes, options: ServeOptions) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The sentences, search options and controls of a /translate body, or an ApiError saying what is wrong."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON here: it nests too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ApiError(400, f"the body is not valid JSON here: {str(exc).split(';')[0]}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, 'the body must be a JSON object like {"text": ["a sentence"]}')
    text = payload.pop("text", None)
    if not isinstance(text, list) or not text or not all(isinstance(t, str) for t in text):
        raise ApiError(422, '"text" must be a non-empty list of strings')
    for number, sentence in enumerate(text, start=1):
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError:  # JSON can escape half of a UTF-16 pair ("\ud800"): not a character
            raise ApiError(422, f'"text" sentence {number} holds a lone surrogate escape, not a character') from None
    if len(text) > options.max_sentences:
        raise ApiError(413, f"{len(text)} sentences in one request; at most {options.max_sentences}")
    controls = {name: payload.pop(name) for name in CONTROL_FIELDS if name in payload}
    check_control_sizes(controls, options)
    characters = sum(len(t) for t in text) + sum(len(s) for s in strings_in(list(controls.values())))
    if characters > options.max_characters:
        raise ApiError(413, f"{characters} characters in one request" + (" (text and controls)" if controls else "") +
                       f"; at most {options.max_characters}")
    unknown = sorted(set(payload) - set(REQUEST_OPTIONS))
    if unknown:
        raise ApiError(422, f"unknown field(s) {', '.join(unknown)}; known: text, {', '.join(REQUEST_OPTIONS)}, "
                            f"{', '.join(CONTROL_FIELDS)}")
    defaults = SearchOptions()
    for name, value in payload.items():
        expected = type(getattr(defaults, name))
        number = expected is float and isinstance(value, int)
        if isinstance(value, bool) or not (isinstance(value, expected) or number) or \
                (expected is float and not math.isfinite(value)):
            wanted = {float: "a finite number", int: "an integer", str: "a string"}[expected]
            raise ApiError(422, f'"{name}" must be {wanted}, got {json_type(value)}')
    most_output = options.max_output_length
    limits = {"beam": (options.max_beam, "--max-beam"), "max_len_a": (MAX_LEN_A, ""),
              "max_len_b": (most_output, "--max-output-length"), "min_len": (most_output, "--max-output-length"),
              "no_repeat_ngram_size": (most_output, "--max-output-length")}
    for name, (most, server_flag) in limits.items():
        if payload.get(name, getattr(defaults, name)) > most:
            raise ApiError(422, f'"{name}" must be at most {most:g}' +
                           (f" (the server's {server_flag})" if server_flag else ""))
    return text, payload, controls


def check_control_sizes(controls: dict[str, Any], options: ServeOptions) -> None:
    """Too many banned phrases, or constraints for one sentence: a 413 from their counts alone (their
    types are checked with their encoding)."""
    bans = controls.get("ban")
    if isinstance(bans, list) and len(bans) > options.max_bans:
        raise ApiError(413, f'{len(bans)} phrases in "ban"; at most {options.max_bans} (the server\'s --max-bans)')
    constraints = controls.get("constraints")
    for number, phrases in enumerate(constraints if isinstance(constraints, list) else [], start=1):
        if isinstance(phrases, list) and len(phrases) > options.max_constraints:
            raise ApiError(413, f'{len(phrases)} constraints for text {number}; at most {options.max_constraints} '
                                "(the server's --max-constraints)")


def strings_in(value: Any) -> list[str]:
    """The strings in a JSON value of lists (what a control holds)."""
    if isinstance(value, str):
        return [value]
    return [s for item in value for s in strings_in(item)] if isinstance(value, list) else []


def prepare(translator: Translator, body: bytes, options: ServeOptions,
            should_stop: Callable[[], bool] | None = None) -> Prepared:
    """A request's body, parsed, encoded and checked: an ApiError for what is wrong with it, SearchStopped
    (from the controls) when ``should_stop`` says its client has gone."""
    texts, overrides, given = parse_request(body, options)
    try:
        search, _ = translator.options(**overrides)
    except NmtError as exc:
        raise ApiError(422, in_request_terms(str(exc))) from exc
    sources = encode_sources(translator.vocabs, texts)
    try:  # here, not in the batch: one request's sentence must not fail the others batched with it
        check_lengths(translator.model, sources)
        controls = controls_from_lists(translator.vocabs.target, len(texts), *(given.get(f) for f in CONTROL_FIELDS),
                                       names=tuple(f'"{f}"' for f in CONTROL_FIELDS),
                                       most_pieces=options.max_phrase_pieces, should_stop=should_stop)
        if controls is not None:
            controls = check_controls(sources, controls, search, model_positions(translator.model))
    except NmtError as exc:
        raise ApiError(422, in_request_terms(str(exc).replace("input line", "text"))) from exc
    return Prepared(sources, search, controls, output_limits(translator.model, sources, search, options))


def output_limits(model, sources: list, search: SearchOptions, options: ServeOptions) -> list[int]:
    """The longest output each source may reach, or a 422 for one beyond --max-output-length."""
    lengths = torch.tensor([len(source) - 1 for source in sources])  # EOS excluded
    limits = max_lengths(lengths, search.max_len_a, search.max_len_b, model_positions(model)).tolist()
    for number, (length, limit) in enumerate(zip(lengths.tolist(), limits), start=1):
        if limit > options.max_output_length:
            raise ApiError(422, f"text {number} may reach {limit} output tokens (max_len_a {search.max_len_a:g} x "
                                f"its {length} tokens + max_len_b {search.max_len_b}); the server's "
                                f"--max-output-length is {options.max_output_length}: lower max_len_a or max_len_b")
    return limits


def in_request_terms(message: str) -> str:
    """An option's error as a request names the option: "beam", not --beam (whole flags only:
    --lenpen is not the start of --lenpen-style)."""
    fields = {flag(name): f'"{name}"' for name in REQUEST_OPTIONS}
    return re.sub(r"--[a-z0-9-]+", lambda found: fields.get(found.group(0), found.group(0)), message)


def json_type(value: Any) -> str:
    """What a JSON value is, in words; NaN and the infinities (which Python's json reads) by name."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
