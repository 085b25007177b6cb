"""ordered_map: results in the order of the items whatever order they finish in, a bounded
number drawn ahead of the caller, and a worker's error raised where the caller reads its result."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

from nmt.parallel import ordered_map


def test_results_keep_the_items_order_when_a_later_item_finishes_first():
    second_done = threading.Event()

    def work(item: int) -> int:
        if item == 0:
            assert second_done.wait(timeout=30)  # item 1 finishes before item 0
        else:
            second_done.set()
        return item * 10

    assert list(ordered_map(work, range(2), threads=2)) == [0, 10]


@pytest.mark.parametrize("ahead", [1, 2, 5])
def test_at_most_ahead_items_are_drawn_before_the_caller_takes_a_result(ahead):
    drawn = []

    def items() -> Iterator[int]:
        for item in range(20):
            drawn.append(item)
            yield item

    for taken, result in enumerate(ordered_map(lambda item: item, items(), threads=1, ahead=ahead), start=1):
        assert result == taken - 1
        assert len(drawn) - taken <= ahead - 1, (len(drawn), taken)
    assert len(drawn) == 20


def test_without_ahead_every_item_is_submitted_at_once():
    drawn = []

    def items() -> Iterator[int]:
        for item in range(6):
            drawn.append(item)
            yield item

    results = ordered_map(lambda item: item, items(), threads=2)
    assert next(results) == 0 and len(drawn) == 6
    assert list(results) == [1, 2, 3, 4, 5]


def test_each_thread_runs_the_initializer_and_an_error_reaches_the_caller():
    local = threading.local()

    def work(item: int) -> int:
        if item == 3:
            raise ValueError("bad item 3")
        return local.offset + item

    results = ordered_map(work, range(6), threads=2, initializer=lambda: setattr(local, "offset", 100))
    assert [next(results) for _ in range(3)] == [100, 101, 102]
    with pytest.raises(ValueError, match="bad item 3"):
        next(results)
