"""``map`` on a few threads, results in order: preprocess encodes chunks while the next is read,
generate decodes several batches at once (``--workers``)."""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def ordered_map(function: Callable[[Item], Result], items: Iterable[Item], threads: int, ahead: int | None = None,
                initializer: Callable[[], object] | None = None, name: str = "nmt-worker") -> Iterator[Result]:
    """``map(function, items)`` on ``threads`` threads of its own, results in the order of ``items``.

    ``items`` is drawn in the caller's thread, so reading the next items overlaps the work. At most
    ``ahead`` items are submitted and not yet returned (bounded memory for a stream); None submits
    them all at once (a list already in memory). Each thread runs ``initializer`` first. An error
    in ``function`` reaches the caller with its result; the items not started by then are cancelled.
    """
    with ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=initializer) as pool:
        pending: collections.deque[Future[Result]] = collections.deque()
        try:
            for item in items:
                pending.append(pool.submit(function, item))
                if ahead is not None and len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
