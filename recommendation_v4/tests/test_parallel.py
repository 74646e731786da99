"""in_order: results in the items' order, never more than ``ahead`` items in flight."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dlrmv4.parallel import in_order


@pytest.mark.parametrize("ahead", [1, 3])
def test_results_come_in_order_with_a_bounded_number_ahead(ahead):
    started: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.001 * ((7 * i) % 5))  # finish out of order
        return i * i

    taken = []
    with ThreadPoolExecutor(4) as pool:
        for result in in_order(pool, work, range(20), ahead):
            taken.append(result)
            assert len(started) <= len(taken) + ahead  # each taken result was replaced by one new item
    assert taken == [i * i for i in range(20)]


def test_an_error_comes_at_its_item():
    def work(i: int) -> int:
        if i == 3:
            raise ValueError("item 3")
        return i

    with ThreadPoolExecutor(2) as pool:
        results = in_order(pool, work, range(6), 2)
        assert [next(results) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="item 3"):
            next(results)
