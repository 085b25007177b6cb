"""The server's dynamic batching, driven directly: who shares a batch, and when the queue is full."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from nmt.generation.options import SearchOptions
from nmt.generation.search import Hypothesis, SearchStopped
from nmt.serving.batcher import Batcher, QueueFull, WorkerGone
from nmt.serving.budget import NO_CONTROLS, ControlShape, control_bytes


def source(token: int) -> np.ndarray:
    return np.asarray([token, 3], dtype=np.int64)


class RowMemory:
    """A batch takes a byte per row, whatever its lengths, and its sentences' controls (see SearchMemory)."""

    @staticmethod
    def row(longest_output: int) -> int:
        return 1

    @staticmethod
    def sentence(longest_source: int, beam: int, controls: ControlShape = NO_CONTROLS) -> int:
        return control_bytes(controls, beam)

    def batch(self, output_limits: list[int], beam: int, longest_source: int) -> int:
        return beam * len(output_limits)


def batcher_of(translate, budget: int = 10_000, max_waiting: int = 100, long_search: int = 10_000) -> Batcher:
    return Batcher(translate, window=0.0, memory=RowMemory(), budget=budget, max_waiting=max_waiting,
                   long_search=long_search)


def submit(batcher: Batcher, sources: list[np.ndarray], options: SearchOptions):
    return batcher.submit(sources, options, [10] * len(sources))


class ScriptedTranslate:
    """Records each call; the first call waits until released, so later requests pile up meanwhile."""

    def __init__(self):
        self.calls: list[tuple[list[int], int]] = []
        self.release = threading.Event()

    def __call__(self, sources, options, controls, should_stop):
        if not self.calls:
            self.release.wait(60)
        self.calls.append(([int(s[0]) for s in sources], options.beam))
        return [[Hypothesis([int(s[0]), 3], -float(s[0]))] for s in sources]


def test_requests_arriving_while_a_batch_runs_share_the_next_one_by_options():
    async def scenario():
        translate = ScriptedTranslate()
        batcher = batcher_of(translate)
        worker = asyncio.create_task(batcher.run())
        beam4, beam2 = SearchOptions(), SearchOptions(beam=2)
        first = submit(batcher, [source(10)], beam4)
        while batcher.line:  # the worker took the first request and is translating it
            await asyncio.sleep(0.01)
        others = [submit(batcher, [source(20), source(21)], beam4), submit(batcher, [source(30)], beam2),
                  submit(batcher, [source(40)], beam4)]
        assert batcher.waiting == 5
        translate.release.set()
        answers = [await future for future in [first, *others]]
        worker.cancel()
        return translate.calls, answers, batcher.waiting

    calls, answers, waiting = asyncio.run(scenario())
    assert calls == [([10], 4), ([20, 21, 40], 4), ([30], 2)]
    assert [[hyps[0].tokens[0] for hyps in answer] for answer in answers] == [[10], [20, 21], [30], [40]]
    assert waiting == 0


def test_a_full_queue_refuses_until_sentences_are_done():
    async def scenario():
        translate = ScriptedTranslate()
        batcher = batcher_of(translate, max_waiting=3)
        worker = asyncio.create_task(batcher.run())
        first = submit(batcher, [source(1), source(2)], SearchOptions())
        with pytest.raises(QueueFull, match="2 sentences are waiting"):
            submit(batcher, [source(3), source(4)], SearchOptions())
        second = submit(batcher, [source(5)], SearchOptions())
        translate.release.set()
        await first, await second
        again = await submit(batcher, [source(6), source(7), source(8)], SearchOptions())
        worker.cancel()
        return len(again)

    assert asyncio.run(scenario()) == 3


def test_a_failed_translation_fails_its_requests_not_the_worker():
    async def scenario():
        calls = []

        def translate(sources, options, controls, should_stop):
            calls.append(len(sources))
            if len(calls) == 1:
                raise RuntimeError("out of memory")
            return [[Hypothesis([3], 0.0)] for _ in sources]

        batcher = batcher_of(translate, max_waiting=10)
        worker = asyncio.create_task(batcher.run())
        with pytest.raises(RuntimeError, match="out of memory"):
            await submit(batcher, [source(1)], SearchOptions())
        answer = await submit(batcher, [source(2)], SearchOptions())
        worker.cancel()
        return answer, batcher.waiting, batcher.stats

    answer, waiting, stats = asyncio.run(scenario())
    assert len(answer) == 1 and waiting == 0
    assert (stats.batches, stats.sentences, stats.abandoned) == (1, 1, 0)  # failed: neither translated nor abandoned


def test_a_request_bigger_than_a_batch_takes_turns_with_those_that_arrive_meanwhile():
    async def scenario():
        translate = ScriptedTranslate()
        batcher = batcher_of(translate, budget=8)  # two sentences at beam 4
        worker = asyncio.create_task(batcher.run())
        heavy = submit(batcher, [source(t) for t in (1, 2, 3, 4, 5)], SearchOptions())
        while batcher.line:
            await asyncio.sleep(0.01)
        light = submit(batcher, [source(9)], SearchOptions(beam=2))
        translate.release.set()
        answers = await heavy, await light
        worker.cancel()
        return translate.calls, answers, batcher.waiting

    calls, (heavy, light), waiting = asyncio.run(scenario())
    assert calls == [([1, 2], 4), ([9], 2), ([3, 4], 4), ([5], 4)]
    assert [hyps[0].tokens[0] for hyps in heavy] == [1, 2, 3, 4, 5] and light[0][0].tokens[0] == 9
    assert waiting == 0


def test_a_request_gone_leaves_the_line_and_a_batch_of_gone_requests_stops():
    """A cancelled future (the server's timeout, or a client that left): its waiting sentences are
    dropped at once, and the search of a batch holding only gone requests is told to stop."""
    async def scenario():
        steps, started = [], asyncio.Event()
        loop = asyncio.get_running_loop()

        def translate(sources, options, controls, should_stop):
            loop.call_soon_threadsafe(started.set)
            while not should_stop():  # a search asks before each step
                steps.append(len(sources))
                time.sleep(0.001)
                assert len(steps) < 60_000, "never told to stop"
            raise SearchStopped

        batcher = batcher_of(translate, budget=8)
        worker = asyncio.create_task(batcher.run())
        running = submit(batcher, [source(1), source(2)], SearchOptions())
        await started.wait()
        waiting = submit(batcher, [source(3)], SearchOptions(beam=2))
        assert batcher.waiting == 3
        waiting.cancel()
        await asyncio.sleep(0)  # the future's callbacks run
        assert batcher.waiting == 2 and not batcher.line
        running.cancel()
        while batcher.waiting:
            await asyncio.sleep(0.01)
        worker.cancel()
        return batcher.stats

    stats = asyncio.run(scenario())
    assert (stats.batches, stats.sentences, stats.abandoned) == (0, 0, 3)


def test_a_light_request_does_not_wait_for_a_heavy_ones_turn():
    """Sentences that may search long (beam x longest output over long_search) have a worker of their own."""
    async def scenario():
        release, calls = threading.Event(), []

        def translate(sources, options, controls, should_stop):
            calls.append(options.beam)
            if options.beam == 16:
                assert release.wait(60)
            return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]

        batcher = batcher_of(translate, long_search=16 * 10 - 1)
        worker = asyncio.create_task(batcher.run())
        heavy = submit(batcher, [source(1)], SearchOptions(beam=16))
        while not calls:
            await asyncio.sleep(0.01)
        light = await submit(batcher, [source(2)], SearchOptions(beam=15))  # while the heavy one is translated
        release.set()
        await heavy
        worker.cancel()
        return calls, light

    calls, light = asyncio.run(scenario())
    assert calls == [16, 15] and light[0][0].tokens == [2, 3]


def test_controls_follow_their_sentences_across_turns_in_batches_of_their_own():
    """A request with controls is batched alone (its controls never pad another request's sentences):
    the translate call gets one control per source, each sentence its own across turns; the plain
    request's batch gets None."""
    from nmt.generation.constraints import SentenceControls

    seen: list[list | None] = []

    def translate(sources, options, controls, should_stop):
        seen.append(controls)
        return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]

    async def scenario():
        batcher = batcher_of(translate, budget=300)  # RowMemory and 120 bytes of controls a sentence: two a batch
        worker = asyncio.create_task(batcher.run())
        prefixed = [SentenceControls(prefix=[7]), None, SentenceControls(bans=[[9]]), SentenceControls(prefix=[8])]
        first = batcher.submit([source(1), source(2), source(3), source(4)], SearchOptions(), [10] * 4, prefixed)
        plain = submit(batcher, [source(5)], SearchOptions())
        await first, await plain
        worker.cancel()

    asyncio.run(scenario())
    assert seen == [[SentenceControls(prefix=[7]), None], None,
                    [SentenceControls(bans=[[9]]), SentenceControls(prefix=[8])]]


class LengthMemory:
    """Memory by hand: a row takes its longest output, a sentence its batch's longest source per beam."""

    @staticmethod
    def row(longest_output: int) -> int:
        return longest_output

    @staticmethod
    def sentence(longest_source: int, beam: int, controls: ControlShape = NO_CONTROLS) -> int:
        return longest_source * beam

    def batch(self, output_limits: list[int], beam: int, longest_source: int) -> int:
        return sum(beam * self.row(limit) for limit in output_limits) + \
            len(output_limits) * self.sentence(longest_source, beam)


def sentence_of(token: int, length: int) -> np.ndarray:
    """A source of ``length`` tokens, EOS included, its words all ``token``."""
    return np.asarray([token] * (length - 1) + [3], dtype=np.int64)


def test_a_sentence_joins_a_batch_only_when_the_batch_with_it_fits_the_budget():
    """Beam 1, a budget of 23: each request (one sentence: source length, longest output) joins the
    batch being gathered while the batch's memory with it (its own row, and every sentence padded to
    the longest source) is at most 23; a batch's first sentence always goes."""
    requests = {1: (2, 10), 2: (2, 9),  # 10 + 9 + 2 x 2 = 23: fits exactly
                3: (2, 1), 4: (2, 30),  # 1 + 30 + 2 x 2 = 35: its own output does not fit
                5: (9, 1), 6: (2, 1),  # 1 + 1 + 2 x 9 = 20: padded to the longer source, fits
                7: (2, 1),  # 3 x 1 + 3 x 9 = 30: the third does not
                8: (11, 1)}  # after 7: 1 + 1 + 2 x 11 = 24: its source pads the others past the budget

    async def scenario():
        translate = ScriptedTranslate()
        batcher = Batcher(translate, window=0.0, memory=LengthMemory(), budget=23, max_waiting=100,
                          long_search=10_000)
        worker = asyncio.create_task(batcher.run())
        options = SearchOptions(beam=1)
        futures = [batcher.submit([sentence_of(0, 2)], options, [1])]
        while batcher.line:  # the first request is being translated: the others pile up
            await asyncio.sleep(0.01)
        futures += [batcher.submit([sentence_of(token, length)], options, [limit])
                    for token, (length, limit) in requests.items()]
        translate.release.set()
        for future in futures:
            await future
        worker.cancel()
        return translate.calls, batcher.waiting

    calls, waiting = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [tokens for tokens, _ in calls] == [[0], [1, 2], [3], [4], [5, 6], [7], [8]]
    assert waiting == 0


def test_a_request_that_leaves_during_its_turn_stops_waiting_and_takes_no_other_turn():
    """Its first two sentences are being translated (with another request's) when it goes: the third
    never is, nothing of it counts as waiting, and the queue takes a full request again."""
    async def scenario():
        translate = ScriptedTranslate()
        batcher = batcher_of(translate, budget=12, max_waiting=5)  # RowMemory, beam 4: three sentences a batch
        worker = asyncio.create_task(batcher.run())
        leaving = submit(batcher, [source(1), source(2), source(3), source(4)], SearchOptions())
        while batcher.line:
            await asyncio.sleep(0.01)
        staying = submit(batcher, [source(5)], SearchOptions())
        leaving.cancel()
        await asyncio.sleep(0)  # the future's callbacks run
        translate.release.set()
        answer = await staying
        deadline = time.monotonic() + 10
        while batcher.waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        waiting = batcher.waiting
        assert waiting == 0, f"{waiting} sentences of nobody count as waiting"
        again = await submit(batcher, [source(6 + i) for i in range(5)], SearchOptions())
        worker.cancel()
        return translate.calls, answer, again, batcher.stats

    calls, answer, again, stats = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [tokens for tokens, _ in calls] == [[1, 2, 3], [5], [6, 7, 8], [9, 10]]
    assert answer[0][0].tokens == [5, 3] and len(again) == 5
    assert (stats.sentences, stats.abandoned) == (9, 1)


def test_several_light_workers_never_take_the_same_request():
    """Each light worker gathers from the one line on the event loop: every request is translated once."""
    async def scenario():
        calls: dict[str, list[int]] = {"a": [], "b": []}

        def worker(name: str):
            def translate(sources, options, controls, should_stop):
                calls[name] += [int(s[0]) for s in sources]
                time.sleep(0.005)
                return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]
            return translate

        batcher = Batcher(worker("heavy"), window=0.002, memory=RowMemory(), budget=12, max_waiting=1000,
                          long_search=10_000, light=[worker("a"), worker("b")])
        running = asyncio.create_task(batcher.run())
        futures = []
        for token in range(100):
            futures.append(submit(batcher, [source(token)], SearchOptions()))
            if token % 7 == 0:
                await asyncio.sleep(0.003)
        answers = [await future for future in futures]
        running.cancel()
        return calls, answers

    calls, answers = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [answer[0][0].tokens[0] for answer in answers] == list(range(100))
    assert sorted(calls["a"] + calls["b"]) == list(range(100)) and calls["a"] and calls["b"]


def test_a_worker_gone_with_a_batch_fails_the_requests_still_there_and_counts_the_others_abandoned():
    """A light worker's process ends while it decodes two requests, one of which had already left:
    the one still there gets the error, the other's sentences count as abandoned (not failed), and a
    thread of the server takes the next request."""
    async def scenario():
        started, release = asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def dying(sources, options, controls, should_stop):
            loop.call_soon_threadsafe(started.set)
            release.wait(60)
            raise WorkerGone("decoding worker process 1 ended (killed by SIGKILL)", had_batch=True)

        def thread(sources, options, controls, should_stop):
            return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]

        batcher = Batcher(thread, window=0.05, memory=RowMemory(), budget=100, max_waiting=100,
                          long_search=10_000, light=[dying])
        running = asyncio.create_task(batcher.run())
        leaving = submit(batcher, [source(1), source(2)], SearchOptions())
        staying = submit(batcher, [source(3)], SearchOptions())
        await started.wait()
        leaving.cancel()
        release.set()
        with pytest.raises(WorkerGone):
            await staying
        after = await submit(batcher, [source(4)], SearchOptions())
        running.cancel()
        return batcher.stats, after

    stats, after = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert after[0][0].tokens == [4, 3]
    assert (stats.abandoned, stats.sentences) == (2, 1)


def until_stopped(sources, options, controls, should_stop):
    """A search that runs until told to stop (or 60 s: then it answers, and the test fails)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if should_stop():
            raise SearchStopped
        time.sleep(0.001)
    return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]


def echo_or_fail(sources, options, controls, should_stop):
    """Translates each source to its first token; a batch holding token 51 fails."""
    if any(int(s[0]) == 51 for s in sources):
        raise ValueError("this sentence cannot be translated")
    if any(int(s[0]) == 99 for s in sources):
        return until_stopped(sources, options, controls, should_stop)
    return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]


@pytest.fixture
def forked():
    """Forked worker processes over a function of this module (the children inherit it); ended at the end."""
    from nmt.serving.processes import fork_decoders

    started = []

    def fork(translate, workers: int = 1):
        started.extend(fork_decoders(translate, workers))
        return started[-workers:]

    yield fork
    for decoder in started:
        decoder.close()


def test_a_forked_worker_stops_its_search_when_the_batch_is_abandoned_and_takes_the_next(forked):
    (decoder,) = forked(echo_or_fail)
    asked = time.monotonic() + 0.3
    with pytest.raises(SearchStopped):
        decoder([source(99)], SearchOptions(), None, lambda: time.monotonic() > asked)
    assert time.monotonic() - asked < 10
    assert decoder([source(7)], SearchOptions(), None, lambda: False)[0][0].tokens == [7, 3]


def test_a_request_that_fails_in_a_worker_process_fails_alone(forked):
    """Its batch is tried again request by request: only the request that causes the error gets it."""
    async def scenario():
        batcher = Batcher(echo_or_fail, window=0.2, memory=RowMemory(), budget=10_000, max_waiting=100,
                          long_search=10_000, light=forked(echo_or_fail))
        running = asyncio.create_task(batcher.run())
        futures = [submit(batcher, [source(token)], SearchOptions()) for token in (50, 51, 52)]
        answers = await asyncio.gather(*futures, return_exceptions=True)
        running.cancel()
        return answers, batcher.waiting

    answers, waiting = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert answers[0][0][0].tokens == [50, 3] and answers[2][0][0].tokens == [52, 3]
    assert isinstance(answers[1], ValueError) and "cannot be translated" in str(answers[1]) and waiting == 0


def test_workers_forked_before_one_that_cannot_be_are_ended(monkeypatch):
    """A fork that fails (out of memory, a process limit) leaves none of the server's workers running."""
    from nmt.serving import processes

    started = []

    class FailingSecond(processes.ForkedTranslate):
        def __init__(self, translate, prctl):
            if started:
                raise OSError("cannot fork")
            super().__init__(translate, prctl)
            started.append(self)

    monkeypatch.setattr(processes, "ForkedTranslate", FailingSecond)
    with pytest.raises(OSError, match="cannot fork"):
        processes.fork_decoders(echo_or_fail, 2)
    assert len(started) == 1 and not started[0].process.is_alive()


class NeedsTwo(Exception):
    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")


def fails_in_ways_a_pipe_cannot_carry(sources, options, controls, should_stop):
    """Token 1: an exception that pickles but cannot be rebuilt; token 2: one that cannot be pickled."""
    if int(sources[0][0]) == 1:
        raise NeedsTwo("sentence", "cannot be translated")
    if int(sources[0][0]) == 2:
        error = ValueError("holds a lock")
        error.lock = threading.Lock()
        raise error
    return [[Hypothesis([int(s[0]), 3], 0.0)] for s in sources]


def test_an_exception_the_server_cannot_rebuild_reaches_it_as_one_line_and_the_worker_goes_on(forked):
    (decoder,) = forked(fails_in_ways_a_pipe_cannot_carry)
    with pytest.raises(RuntimeError, match="^NeedsTwo: sentence: cannot be translated$"):
        decoder([source(1)], SearchOptions(), None, lambda: False)
    with pytest.raises(RuntimeError, match="^ValueError: holds a lock$"):
        decoder([source(2)], SearchOptions(), None, lambda: False)
    assert decoder([source(7)], SearchOptions(), None, lambda: False)[0][0].tokens == [7, 3]
