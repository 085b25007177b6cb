"""Dynamic batching for the server: requests that arrive together are translated together.

Requests wait in one queue. The worker takes the first one, then gathers whatever else arrives
within a short window (or until the batch holds enough tokens), and translates each group of
requests that share their search options as one call, in a worker thread so the event loop keeps
accepting requests. While a batch translates, the next requests pile up and make the next batch:
under load the batches grow by themselves, and one lone request waits only for the window.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from nmt.generation.constraints import SentenceControls
from nmt.generation.options import SearchOptions
from nmt.generation.search import Hypothesis

Controls = list[SentenceControls | None]
TranslateFn = Callable[[list[np.ndarray], SearchOptions, Controls | None], list[list[Hypothesis]]]


class QueueFull(Exception):
    """More sentences are waiting than the server accepts: the client should retry later."""


@dataclass
class Job:
    sources: list[np.ndarray]  # token ids ending in EOS
    options: SearchOptions
    future: asyncio.Future
    controls: Controls | None = None  # per source: prefix, constraints, bans
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = sum(len(s) for s in self.sources) * self.options.beam


@dataclass
class BatchStats:
    batches: int = 0
    sentences: int = 0
    seconds: float = 0.0  # spent translating


class Batcher:
    def __init__(self, translate: TranslateFn, window: float, max_tokens: int, max_waiting: int):
        self.translate = translate
        self.window = window  # seconds the worker waits for more requests after the first
        self.max_tokens = max_tokens  # source tokens x beam gathered into one batch at most
        self.max_waiting = max_waiting  # sentences queued or being translated, at most
        self.waiting = 0
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-translate")
        self.stats = BatchStats()

    def submit(self, sources: list[np.ndarray], options: SearchOptions, controls: Controls | None = None
               ) -> asyncio.Future:
        """Queue a request; its future gets the ``nbest`` hypotheses of each source."""
        if self.waiting + len(sources) > self.max_waiting:
            raise QueueFull(f"{self.waiting} sentences are waiting (at most {self.max_waiting}); retry later")
        job = Job(sources, options, asyncio.get_running_loop().create_future(), controls)
        self.waiting += len(sources)
        self.queue.put_nowait(job)
        return job.future

    async def run(self) -> None:
        """The worker: runs until cancelled (at server shutdown)."""
        try:
            while True:
                jobs = await self.gather()
                for group in group_by_options(jobs):
                    await self.translate_group(group)
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def gather(self) -> list[Job]:
        jobs = [await self.queue.get()]
        tokens = jobs[0].tokens
        deadline = asyncio.get_running_loop().time() + self.window
        while tokens < self.max_tokens:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                job = self.queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(self.queue.get(), remaining)
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            jobs.append(job)
            tokens += job.tokens
        return jobs

    async def translate_group(self, jobs: list[Job]) -> None:
        live = [job for job in jobs if not job.future.done()]  # a request that timed out is not translated
        try:
            if not live:
                return
            sources = [source for job in live for source in job.sources]
            controls = [c for job in live for c in job.controls or [None] * len(job.sources)] \
                if any(job.controls for job in live) else None
            start = time.perf_counter()
            loop = asyncio.get_running_loop()
            try:
                results = await loop.run_in_executor(self.executor, self.translate, sources, live[0].options, controls)
            except Exception as exc:  # noqa: BLE001  (each request gets the error; the worker goes on)
                for job in live:
                    if not job.future.done():
                        job.future.set_exception(exc)
                return
            self.stats.batches += 1
            self.stats.sentences += len(sources)
            self.stats.seconds += time.perf_counter() - start
            start_of = 0
            for job in live:
                if not job.future.done():
                    job.future.set_result(results[start_of:start_of + len(job.sources)])
                start_of += len(job.sources)
        finally:
            self.waiting -= sum(len(job.sources) for job in jobs)


def group_by_options(jobs: list[Job]) -> list[list[Job]]:
    """Requests with the same search options share a batch; arrival order is kept within each group."""
    groups: dict[SearchOptions, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.options, []).append(job)
    return list(groups.values())
