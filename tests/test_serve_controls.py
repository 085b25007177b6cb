"""The server's bounds on controls (prefixes, constraints, bans): their caps, their memory in the
batch's estimate, who shares a batch with them, their preparation off the event loop, and the
linear-time checks under them."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import numbers_pairs

import nmt
from nmt.data.vocabulary import PAD_ID, Vocabulary
from nmt.generation.constraints import BatchControls, SentenceControls, contains, transitions
from nmt.generation.options import SearchOptions
from nmt.generation.search import Hypothesis, SearchStopped
from nmt.generation.translator import Translator
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.serving.batcher import Batcher
from nmt.serving.budget import ControlShape, SearchMemory
from nmt.serving.options import ServeOptions

pytest.importorskip("starlette", reason="nmt serve needs the serve extra: pip install -e '.[serve]' in nmt's checkout")
pytest.importorskip("uvicorn", reason="nmt serve needs the serve extra: pip install -e '.[serve]' in nmt's checkout")

from test_serve import GIVE_UP, call_app, request, run_server  # noqa: E402
from test_translator import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    vocab = Vocabulary.train([side for pair in numbers_pairs(300, seed=1) for side in pair], vocab_size=120)
    return tiny_checkpoint(tmp_path_factory.mktemp("controls") / "model.pt", vocab)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """A server with the default limits (64 bans, 8 constraints a sentence, 16 pieces a phrase)."""
    yield from run_server(checkpoint, tmp_path_factory)


@pytest.mark.parametrize("body,status,message", [
    ({"text": ["five"], "ban": ["sieben"] * 65}, 413, '65 phrases in "ban"; at most 64 (the server\'s --max-bans)'),
    ({"text": ["five", "six"], "constraints": [None, ["sieben"] * 9]}, 413,
     "9 constraints for text 2; at most 8 (the server's --max-constraints)"),
    ({"text": ["five"], "ban": ["sieben acht neun zehn " * 5]}, 422, '"ban" phrase 1 '),
    ({"text": ["five"], "constraints": [["sieben acht neun zehn " * 5]]}, 422, "text 1: constraint 1 "),
    ({"text": ["five"], "ban": ["acht" * 5000]}, 413, "characters in one request (text and controls); at most 20000"),
    # the request, smaller: many bans, one of them long, at the largest beam
    ({"text": ["five"], "beam": 16, "ban": ["sieben"] * 99 + ["sieben acht " * 100]}, 413, '100 phrases in "ban"'),
])
def test_controls_beyond_their_caps_are_refused(served, body, status, message):
    got, answer = request(served, "POST", "/translate", body)
    assert (got, list(answer)) == (status, ["error"]), answer
    assert message in answer["error"] and "\n" not in answer["error"]
    if status == 422:
        assert "pieces; at most 16 a phrase" in answer["error"]


def tiny_model():
    arch = get_arch("transformer_tiny")
    torch.manual_seed(0)
    return build_model(arch.model_name, resolve_config(arch.config, {"d_model": 32, "ffn_dim": 64}), 120, 120, PAD_ID)


def source(token: int) -> np.ndarray:
    return np.asarray([token, 3], dtype=np.int64)


class Recorded:
    """A translate function for the batcher that records each batch's first tokens and its controls."""

    def __init__(self, poison: int | None = None):
        self.batches: list[list[int]] = []
        self.controls: list[object] = []
        self.poison = poison

    def __call__(self, sources, options, controls, should_stop):
        tokens = [int(s[0]) for s in sources]
        self.batches.append(tokens)
        self.controls.append(controls)
        if self.poison in tokens:
            raise ValueError("this sentence cannot be translated")
        return [[Hypothesis([token, 3], 0.0)] for token in tokens]


def run_requests(translate, requests: list[tuple[list[int], list | None]], budget: int, window: float = 0.2):
    """Submit the requests together to a batcher over the tiny model's memory estimate; their answers or errors."""
    async def scenario():
        memory = SearchMemory(tiny_model(), "fp32", "cpu")
        batcher = Batcher(translate, window, memory, budget, 1000, long_search=10 ** 9)
        worker = asyncio.create_task(batcher.run())
        futures = [batcher.submit([source(t) for t in tokens], SearchOptions(), [10] * len(tokens), controls)
                   for tokens, controls in requests]
        answers = await asyncio.gather(*futures, return_exceptions=True)
        worker.cancel()
        return answers, batcher.waiting

    return asyncio.run(scenario())


BANS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20 + i] for i in range(64)]  # 64 of 16 pieces


def test_a_requests_controls_count_in_its_batches_memory():
    """Eight sentences whose search fits one batch take several once their bans are counted."""
    memory = SearchMemory(tiny_model(), "fp32", "cpu")
    budget = int(1.05 * memory.batch([10] * 8, 4, 2))
    translate = Recorded()
    answers, waiting = run_requests(translate, [(list(range(30, 38)), [SentenceControls(bans=BANS)] * 8)], budget)
    assert len(answers[0]) == 8 and waiting == 0
    assert len(translate.batches) > 1 and sum(map(len, translate.batches)) == 8


def test_a_request_with_controls_is_batched_alone():
    """Its bans would pad every other sentence of the batch: other clients' sentences never share it."""
    translate = Recorded()
    controlled = [SentenceControls(bans=BANS[:2])] * 2
    answers, _ = run_requests(translate, [([40], None), ([41, 42], controlled), ([43], None)], budget=10 ** 12)
    assert [[hyps[0].tokens[0] for hyps in answer] for answer in answers] == [[40], [41, 42], [43]]
    assert sorted(translate.batches) == [[40, 43], [41, 42]]
    assert translate.controls[translate.batches.index([40, 43])] is None


def test_a_failing_batch_fails_only_the_request_that_causes_it():
    translate = Recorded(poison=51)
    answers, waiting = run_requests(translate, [([50], None), ([51], None), ([52], None)], budget=10 ** 12)
    assert [hyps[0].tokens[0] for hyps in answers[0]] == [50] and [hyps[0].tokens[0] for hyps in answers[2]] == [52]
    assert isinstance(answers[1], ValueError) and waiting == 0
    assert translate.batches[0] == [50, 51, 52]  # together first, then each alone


def test_a_stopped_search_builds_no_control_tables(monkeypatch):
    """transitions() and the control tensors are built before the search's first step: a request whose
    client has gone must not pay for them."""
    from nmt.generation.inference import TranslationRequest, translate_ids

    built = []
    monkeypatch.setattr(BatchControls, "create", classmethod(lambda cls, *args: built.append(args)))
    with pytest.raises(SearchStopped):
        translate_ids(tiny_model(), [source(30)], TranslationRequest(controls=[SentenceControls(bans=BANS)],
                                                                     should_stop=lambda: True))
    assert built == []


def python_lines_run(function, *args):
    """How many lines of nmt's own code ``function(*args)`` runs: work that grows with the inputs'
    product shows here, deterministically, whatever the machine's speed."""
    package, lines = str(Path(nmt.__file__).parent), 0

    def trace(frame, event, arg):
        nonlocal lines
        if not frame.f_code.co_filename.startswith(package):
            return None
        lines += event == "line"
        return trace

    sys.settrace(trace)
    try:
        function(*args)
    finally:
        sys.settrace(None)
    return lines


def test_the_controls_checks_take_linear_time():
    """A prefix against bans and a long constraint's automaton: quadratic or worse, they took seconds
    (the prefix against each ban alone is 5,000 x 500 comparisons)."""
    from nmt.generation.control_input import sentence_controls

    class Pieces:  # a vocabulary whose text is its pieces' numbers
        @staticmethod
        def encode(text):
            return [int(word) for word in text.split()]

        @staticmethod
        def decode(ids):
            return " ".join(map(str, ids))

    prefix = " ".join(str(4 + i % 90) for i in range(5000))
    bans = [[100 + i, 101 + i] for i in range(500)]
    constraint = " ".join(str(4 + i % 3) for i in range(60))
    made = []
    lines = python_lines_run(lambda: made.append(sentence_controls(Pieces(), prefix, [constraint] * 3, bans,
                                                                   "input line 1")))
    lines += python_lines_run(BatchControls, made, torch.device("cpu"))
    assert lines < 50_000  # 9,333 when written; a check of the prefix against each ban alone runs millions
    assert len(made[0].constraints) == 1  # the same constraint three times is kept once


def test_the_automaton_and_the_search_find_what_the_definitions_say():
    def matched(text, phrase):
        return max(j for j in range(min(len(text), len(phrase)) + 1) if text[len(text) - j:] == phrase[:j])

    chosen = random.Random(0)
    for _ in range(500):
        phrase = [chosen.randint(4, 6) for _ in range(chosen.randint(1, 8))]
        assert transitions(phrase) == [[matched(phrase[:state] + [piece], phrase) for piece in phrase]
                                       for state in range(len(phrase) + 1)], phrase
        tokens = [chosen.randint(4, 6) for _ in range(chosen.randint(0, 12))]
        assert contains(tokens, phrase) == any(tokens[i:i + len(phrase)] == phrase
                                               for i in range(len(tokens) - len(phrase) + 1))


def test_info_reports_the_control_caps(served):
    limits = request(served, "GET", "/info")[1]["limits"]
    assert (limits["max_bans"], limits["max_constraints"], limits["max_phrase_pieces"]) == (64, 8, 16)


def test_a_batch_memory_that_holds_a_sentence_but_not_its_controls_at_their_caps_is_refused(checkpoint):
    """The budget must hold the heaviest request the limits allow, controls included: with them left out,
    a --max-batch-memory that fits only the search was accepted, and a request with controls at their
    caps went over the bound /info reports."""
    from nmt.errors import NmtError
    from nmt.generation.search import model_positions
    from nmt.serving.server import MIB, batch_budget

    translator = Translator.from_checkpoint(str(checkpoint))
    memory = SearchMemory(translator.model, translator.precision, translator.device.type)
    limits = ServeOptions(path=str(checkpoint))
    longest_source = model_positions(translator.model)
    assert longest_source < 4 * limits.max_characters  # the model's positions, not the text cap, bound a source
    at_caps = ControlShape(prefix=limits.max_output_length, constraints=limits.max_constraints,
                           constraint_pieces=limits.max_phrase_pieces, bans=limits.max_bans,
                           ban_pieces=limits.max_phrase_pieces)
    search_only = memory.batch([limits.max_output_length], limits.max_beam, longest_source)
    with_controls = memory.batch([limits.max_output_length], limits.max_beam, longest_source, at_caps)
    just_the_search = math.ceil(search_only / MIB)
    assert just_the_search * MIB < with_controls  # the controls need at least a MiB more
    with pytest.raises(NmtError, match=f"--max-batch-memory {just_the_search} MiB cannot hold one sentence"):
        batch_budget(translator, memory, ServeOptions(path=str(checkpoint), max_batch_memory=just_the_search))
    enough = math.ceil(with_controls / MIB)
    assert batch_budget(translator, memory, ServeOptions(path=str(checkpoint), max_batch_memory=enough)) == enough * MIB


def test_a_client_that_leaves_while_its_controls_are_encoded_gets_499_and_their_encoding_stops(checkpoint,
                                                                                              monkeypatch):
    """Encoding controls is the work that grows with a request, done off the event loop: the client's
    leaving must stop it between sentences (SearchStopped) and be answered 499, not logged as a failure.
    In-process, so that the status of a client that has gone can be seen."""
    from conftest import logged_messages

    from nmt.generation import control_input
    from nmt.serving import request as request_module
    from nmt.serving.server import create_app

    app = create_app(Translator.from_checkpoint(str(checkpoint)), ServeOptions(path=str(checkpoint)))
    body = json.dumps({"text": ["five"] * 8, "prefix": ["sieben"] * 8}).encode()
    real_controls_from_lists, real_sentence_controls = request_module.controls_from_lists, \
        control_input.sentence_controls
    stop_checks, encoded = [], []

    async def scenario():
        loop, leave = asyncio.get_running_loop(), asyncio.Event()

        def controls_from_lists(*args, should_stop=None, **kwargs):
            stop_checks.append(should_stop)
            return real_controls_from_lists(*args, should_stop=should_stop, **kwargs)

        def sentence_controls(vocab, prefix, *args, **kwargs):
            """The first sentence's controls make the client leave, and are done once the server has seen it go."""
            encoded.append(prefix)
            if len(encoded) == 1:
                loop.call_soon_threadsafe(leave.set)
                deadline = time.monotonic() + GIVE_UP  # only so that a broken build fails instead of hanging
                while stop_checks[0] is not None and not stop_checks[0]() and time.monotonic() < deadline:
                    time.sleep(0.01)
            return real_sentence_controls(vocab, prefix, *args, **kwargs)

        monkeypatch.setattr(request_module, "controls_from_lists", controls_from_lists)
        monkeypatch.setattr(control_input, "sentence_controls", sentence_controls)
        received = []

        async def receive() -> dict:
            if not received:
                received.append(body)
                return {"type": "http.request", "body": body, "more_body": False}
            await leave.wait()
            return {"type": "http.disconnect"}

        return await call_app(app, receive)

    with logged_messages() as logged:
        answer = asyncio.run(scenario())
    assert answer == (499, {"error": "the client closed the connection"})
    assert encoded == ["sieben"] and logged == []  # the first of eight sentences only


def test_a_request_is_prepared_off_the_event_loop(monkeypatch, checkpoint):
    """A body's checks are too fast to show where they run (their caps come first, and they take linear
    time): here preparing a request waits until /health has been answered, which it never is while
    that preparation holds the event loop."""
    import socket

    import uvicorn

    from nmt.serving import server

    real_prepare = server.prepare
    preparing, health_answered, seen = threading.Event(), threading.Event(), []

    def prepare_once_health_is_answered(*args, **kwargs):
        preparing.set()
        seen.append(health_answered.wait(30))  # a timeout only so that a broken build fails instead of hanging
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(server, "prepare", prepare_once_health_is_answered)
    app = server.create_app(Translator.from_checkpoint(str(checkpoint)), ServeOptions(path=str(checkpoint)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        address = ("127.0.0.1", sock.getsockname()[1])
        while not uvicorn_server.started:
            time.sleep(0.01)
        answers = []
        sender = threading.Thread(target=lambda: answers.append(request(address, "POST", "/translate",
                                                                         {"text": ["five"]}, key=None)))
        sender.start()
        assert preparing.wait(GIVE_UP)
        assert request(address, "GET", "/health", key=None)[0] == 200
        health_answered.set()
        sender.join()
        assert answers[0][0] == 200 and seen == [True], (answers, seen)
    finally:
        uvicorn_server.should_exit = True
        thread.join(30)
