"""Dynamic batching for the server: requests that arrive together are translated together, in turns.

Requests wait in one line. A worker takes the first one, then, within a short window, the next
ones with the same search options, while the batch's memory (nmt/serving/budget.py: rows times
the longest output each may reach) stays within the budget, and translates them as one call from a
thread of its own, so the event loop keeps accepting requests. Where it can (Linux, CPU), the server
runs one light worker per --threads, each decoding in a forked process of its own
(nmt/serving/processes.py); elsewhere one, decoding on its thread. A request too big for one batch
gives its first sentences and goes back to the end of the line with the rest: it takes turns with
the others instead of holding the model until it is done.

A turn cannot be shorter than one sentence's search, and one sentence at beam 16 decoding 256
steps takes seconds on a CPU. So the requests whose sentences may search long (beam x longest
output over ``long_search``) have a worker of their own, on a thread of this process at a lower
priority with one intra-op thread; a light request never waits behind a heavy one's turn, only
shares the processor with it. That worker stays in this process: its batches are few and long,
their operations large enough that the GIL taken between them barely slows the event loop, and a
process of its own would add a copy of the model's pages to the memory bound for a worker mostly
idle. One batch per worker may then be in memory at once, each within the budget.

A worker process that ends (killed, or out of memory) fails the requests of the batch it had, once
logged; the other workers take the next batches, or, once none is left, a thread of this process.

A request with controls (prefixes, constraints, bans) is batched alone: its sentences are padded
to its own largest control set, never another client's, and the tally counts their tensors. A
batch that fails is tried again request by request, so that the error reaches only the request
that causes it.

A request that has gone (its client timed out or left) leaves the line at once, and a batch whose
requests have all gone stops at its next search step. While a batch translates, the next requests
pile up and make the next batch: under load the batches grow by themselves, and one lone request
waits only for the window.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from nmt.generation.constraints import SentenceControls
from nmt.generation.options import SearchOptions
from nmt.generation.search import Hypothesis, SearchStopped
from nmt.log import logger
from nmt.serving.budget import NO_CONTROLS, ControlShape, SearchMemory

HEAVY_NICENESS = 10  # of 19: still running when the light worker waits for requests
Controls = list[SentenceControls | None]
# (sources, options, their controls or None, should_stop) -> hypotheses
TranslateFn = Callable[[list[np.ndarray], SearchOptions, Controls | None, Callable[[], bool]], list[list[Hypothesis]]]


class QueueFull(Exception):
    """More sentences are waiting than the server accepts: the client should retry later."""


class WorkerGone(Exception):
    """A light worker's process ended (killed, or out of memory); ``had_batch``: whether it had been sent the
    batch (else the batch goes back in line, untouched)."""

    def __init__(self, message: str, had_batch: bool):
        super().__init__(message)
        self.had_batch = had_batch


@dataclass(eq=False)
class Job:
    sources: list[np.ndarray]  # token ids ending in EOS
    options: SearchOptions
    output_limits: list[int]  # the longest output each source may reach
    future: asyncio.Future
    long: bool  # searches long: the heavy requests' worker takes it
    controls: Controls | None = None  # per source: prefix, constraints, bans
    alone: bool = False  # batched with no other request: it has controls, or its batch failed
    control_shape: ControlShape = NO_CONTROLS  # what its sentences' controls are padded to (budget.py)
    done: int = 0  # sources translated so far
    results: list[list[Hypothesis]] = field(default_factory=list)

    @property
    def left(self) -> int:
        return len(self.sources) - self.done


@dataclass
class Piece:
    """Some consecutive sources of a job, in one batch."""
    job: Job
    stop: int  # the job's sources [job.done, stop)


class Tally:
    """The memory of a batch being gathered (see SearchMemory.batch), its controls padded to ``controls``
    (a request with controls is batched alone: its own)."""

    def __init__(self, memory: SearchMemory, beam: int, controls: ControlShape = NO_CONTROLS):
        self.memory, self.beam, self.controls = memory, beam, controls
        self.rows = self.sentences = self.longest_source = 0

    def with_sentence(self, source_length: int, output_limit: int) -> int:
        longest = max(self.longest_source, source_length)
        return self.rows + self.beam * self.memory.row(output_limit) + \
            (self.sentences + 1) * self.memory.sentence(longest, self.beam, self.controls)

    def add(self, source_length: int, output_limit: int) -> None:
        self.rows += self.beam * self.memory.row(output_limit)
        self.sentences += 1
        self.longest_source = max(self.longest_source, source_length)


@dataclass
class BatchStats:
    batches: int = 0
    sentences: int = 0  # translated
    abandoned: int = 0  # not translated, or not to the end: their request had gone
    seconds: float = 0.0  # spent translating


class Batcher:
    """``translate`` decodes on a thread of this process: the heavy requests' batches, and the light ones'
    unless ``light`` gives one function per light worker (each a forked process: nmt/serving/processes.py)."""

    def __init__(self, translate: TranslateFn, window: float, memory: SearchMemory, budget: int, max_waiting: int,
                 long_search: int, light: Sequence[TranslateFn] = ()):
        self.translate = translate
        self.light = list(light) or [translate]
        self.light_workers = len(self.light)  # those whose process has not ended
        self.window = window  # seconds a worker waits for more requests after the first
        self.memory = memory
        self.budget = budget  # bytes one batch may take (SearchMemory.batch)
        self.max_waiting = max_waiting  # sentences queued or being translated, at most
        self.long_search = long_search  # beam x longest output of a sentence beyond which it searches long
        self.waiting = 0
        self.line: collections.deque[Job] = collections.deque()
        self.arrived = {False: asyncio.Event(), True: asyncio.Event()}  # per worker: light, heavy
        self.closing = False  # read by the translating threads: a search stops when the server does
        self.executors = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-translate") for _ in self.light]
        self.heavy_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-translate-long",
                                                 initializer=lower_priority)
        self.stats = BatchStats()

    def submit(self, sources: list[np.ndarray], options: SearchOptions, output_limits: list[int],
               controls: Controls | None = None) -> asyncio.Future:
        """Queue a request; its future gets the ``nbest`` hypotheses of each source. Cancelling the future
        (a timeout, a client that left) takes the request out of the line."""
        if self.waiting + len(sources) > self.max_waiting:
            raise QueueFull(f"{self.waiting} sentences are waiting (at most {self.max_waiting}); retry later")
        job = Job(sources, options, output_limits, asyncio.get_running_loop().create_future(),
                  long=options.beam * max(output_limits) > self.long_search, controls=controls,
                  alone=controls is not None,
                  control_shape=ControlShape.of(controls) if controls else NO_CONTROLS)
        job.future.add_done_callback(lambda _: self.leave_line(job))
        self.waiting += len(sources)
        self.line.append(job)
        self.arrived[job.long].set()
        return job.future

    def leave_line(self, job: Job) -> None:
        """A request answered or gone: if it was waiting for its turn, its other sentences are dropped."""
        if job in self.line:
            self.line.remove(job)
            self.drop(job)

    def drop(self, job: Job, abandoned: bool = True) -> None:
        """The job's untranslated sentences stop waiting: abandoned (their request had gone) or failed."""
        self.stats.abandoned += job.left if abandoned else 0
        self.waiting -= job.left
        job.done = len(job.sources)

    async def run(self) -> None:
        """All workers: run until cancelled (at server shutdown)."""
        try:
            await asyncio.gather(*(self.work(False, translate, executor)
                                   for translate, executor in zip(self.light, self.executors)),
                                 self.work(True, self.translate, self.heavy_executor))
        finally:
            self.closing = True
            for executor in [*self.executors, self.heavy_executor]:
                executor.shutdown(wait=False, cancel_futures=True)

    async def work(self, long: bool, translate: TranslateFn, executor: ThreadPoolExecutor) -> None:
        while True:
            try:
                await self.translate_batch(await self.gather(long), translate, executor)
            except WorkerGone as gone:
                self.light_workers -= 1
                logger.warning("%s; %s%s", gone, "the requests of its batch failed; " if gone.had_batch else "",
                               f"{self.light_workers} other worker process(es) take the next batches"
                               if self.light_workers else "a thread of this process takes the next batches")
                if self.light_workers:
                    return
                translate = self.translate

    def first_waiting(self, long: bool, options: SearchOptions | None = None) -> Job | None:
        """The first job of the worker's line; with ``options``, the first that may join a batch of them."""
        return next((job for job in self.line if job.long == long and (options is None or
                                                                       (job.options == options and not job.alone))),
                    None)

    async def gather(self, long: bool) -> list[Piece]:
        """The first waiting request's next sentences, then, within the window, those of the requests
        after it with the same options, while the batch stays within the memory budget."""
        arrived = self.arrived[long]
        while (first := self.first_waiting(long)) is None:
            arrived.clear()
            await arrived.wait()
        self.line.remove(first)
        tally = Tally(self.memory, first.options.beam, first.control_shape)
        pieces = [self.take(first, tally)]
        deadline = asyncio.get_running_loop().time() + self.window
        while not first.alone:
            job = self.first_waiting(long, first.options)
            if job is None:
                remaining = deadline - asyncio.get_running_loop().time()
                arrived.clear()
                if remaining <= 0 or not await wait_for_event(arrived, remaining):
                    break
                continue
            piece = self.take(job, tally)
            if piece is None:  # its next sentence does not fit: the batch is full
                break
            self.line.remove(job)
            pieces.append(piece)
        return pieces

    def take(self, job: Job, tally: Tally) -> Piece | None:
        """As many of the job's next sentences as fit in the batch (at least one in an empty batch)."""
        stop = job.done
        while stop < len(job.sources):
            length, limit = len(job.sources[stop]), job.output_limits[stop]
            if tally.sentences and tally.with_sentence(length, limit) > self.budget:
                break
            tally.add(length, limit)
            stop += 1
        return Piece(job, stop) if stop > job.done else None

    async def translate_batch(self, pieces: list[Piece], translate: TranslateFn, executor: ThreadPoolExecutor
                              ) -> None:
        sources = [source for piece in pieces for source in piece.job.sources[piece.job.done:piece.stop]]
        options = pieces[0].job.options
        controls = [control for piece in pieces
                    for control in (piece.job.controls or [None] * len(piece.job.sources))[piece.job.done:piece.stop]] \
            if any(piece.job.controls for piece in pieces) else None

        def gone() -> bool:  # asked from the worker thread: a future's done() only reads its state
            return self.closing or all(piece.job.future.done() for piece in pieces)

        start = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(executor, translate, sources, options,
                                                                       controls, gone)
        except SearchStopped:
            for piece in pieces:
                self.drop(piece.job)
            return
        except WorkerGone as exc:  # not a request's fault: none is tried again (nor kills another worker)
            if not exc.had_batch:
                self.put_back(pieces)
                raise
            for piece in pieces:
                gone_before = piece.job.future.done()  # its request had left: abandoned, not failed
                if not gone_before:
                    piece.job.future.set_exception(exc)
                self.drop(piece.job, abandoned=gone_before)
            raise
        except Exception as exc:  # noqa: BLE001  (the request that causes it gets the error; the worker goes on)
            if len(pieces) > 1:  # which one is not known: each goes first in line, to be translated alone
                for piece in pieces:
                    piece.job.alone = True
                self.put_back(pieces)
                return
            job = pieces[0].job
            if not job.future.done():
                job.future.set_exception(exc)
            self.drop(job, abandoned=False)
            return
        self.stats.batches += 1
        self.stats.sentences += len(sources)
        self.stats.seconds += time.perf_counter() - start
        start_of = 0
        for piece in pieces:
            job, count = piece.job, piece.stop - piece.job.done
            job.results += results[start_of:start_of + count]
            job.done, start_of = piece.stop, start_of + count
            self.waiting -= count
            if job.future.done():  # gone while its sentences were translated
                self.drop(job)
            elif job.left:
                self.line.append(job)  # the rest waits for its next turn, behind the requests that came meanwhile
                self.arrived[job.long].set()
            else:
                job.future.set_result(job.results)

    def put_back(self, pieces: list[Piece]) -> None:
        """The pieces' requests go first in line again, in their order, none of their sentences translated."""
        for piece in reversed(pieces):
            self.line.appendleft(piece.job)
            self.arrived[piece.job.long].set()
            if piece.job.future.done():  # gone meanwhile: out again
                self.leave_line(piece.job)


def lower_priority() -> None:
    """The heavy requests' thread yields the processor to the light ones' (Linux: a thread's own nice value)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HEAVY_NICENESS)


async def wait_for_event(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False
