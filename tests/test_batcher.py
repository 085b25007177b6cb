"""The server's dynamic batching, driven directly: who shares a batch, and when the queue is full."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from nmt.generation.options import SearchOptions
from nmt.generation.search import Hypothesis
from nmt.serving.batcher import Batcher, QueueFull


def source(token: int) -> np.ndarray:
    return np.asarray([token, 3], dtype=np.int64)


class ScriptedTranslate:
    """Records each call; the first call waits until released, so later requests pile up meanwhile."""

    def __init__(self):
        self.calls: list[tuple[list[int], int]] = []
        self.release = threading.Event()

    def __call__(self, sources, options, controls=None):
        if not self.calls:
            self.release.wait(60)
        self.calls.append(([int(s[0]) for s in sources], options.beam))
        return [[Hypothesis([int(s[0]), 3], -float(s[0]))] for s in sources]


def test_requests_arriving_while_a_batch_runs_share_the_next_one_by_options():
    async def scenario():
        translate = ScriptedTranslate()
        batcher = Batcher(translate, window=0.0, max_tokens=10_000, max_waiting=100)
        worker = asyncio.create_task(batcher.run())
        beam4, beam2 = SearchOptions(), SearchOptions(beam=2)
        first = batcher.submit([source(10)], beam4)
        while not batcher.queue.empty():  # the worker took the first request and is translating it
            await asyncio.sleep(0.01)
        others = [batcher.submit([source(20), source(21)], beam4), batcher.submit([source(30)], beam2),
                  batcher.submit([source(40)], beam4)]
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
        batcher = Batcher(translate, window=0.0, max_tokens=10_000, max_waiting=3)
        worker = asyncio.create_task(batcher.run())
        first = batcher.submit([source(1), source(2)], SearchOptions())
        with pytest.raises(QueueFull, match="2 sentences are waiting"):
            batcher.submit([source(3), source(4)], SearchOptions())
        second = batcher.submit([source(5)], SearchOptions())
        translate.release.set()
        await first, await second
        again = await batcher.submit([source(6), source(7), source(8)], SearchOptions())
        worker.cancel()
        return len(again)

    assert asyncio.run(scenario()) == 3


def test_a_failed_translation_fails_its_requests_not_the_worker():
    async def scenario():
        calls = []

        def translate(sources, options, controls=None):
            calls.append(len(sources))
            if len(calls) == 1:
                raise RuntimeError("out of memory")
            return [[Hypothesis([3], 0.0)] for _ in sources]

        batcher = Batcher(translate, window=0.0, max_tokens=10_000, max_waiting=10)
        worker = asyncio.create_task(batcher.run())
        with pytest.raises(RuntimeError, match="out of memory"):
            await batcher.submit([source(1)], SearchOptions())
        answer = await batcher.submit([source(2)], SearchOptions())
        worker.cancel()
        return answer, batcher.waiting

    answer, waiting = asyncio.run(scenario())
    assert len(answer) == 1 and waiting == 0
