"""The buffered-claim pool with real threads (no database).

Every wait is bounded: threads are joined with a timeout and asserted to have
finished, and a thread is known to be blocked in the pool by the waiter count
of the condition it waits on (`waiting_takers`, `waiting_fetchers`), not by
sleeping and hoping it got there.
"""

from __future__ import annotations

import queue
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import FakeClock, wait_until

from pgq.consumer import pool as pool_module
from pgq.consumer.pool import HANDOFF_LAG, ClaimPool

BLOCK = 30.0
"""Timeout of a take or wait that must be ended by the pool, never by itself."""
PROMPT = 5.0
"""How long a woken thread may take to finish (far below `BLOCK`)."""


def waiting_takers(pool: ClaimPool[Any]) -> int:
    """Threads blocked in `take` (CPython's `Condition` keeps its waiters in `_waiters`)."""
    return len(pool._filled._waiters)  # type: ignore[attr-defined]


def waiting_fetchers(pool: ClaimPool[Any]) -> int:
    """Threads blocked in `wait_for_space`."""
    return len(pool._emptied._waiters)  # type: ignore[attr-defined]


class Runner:
    """Starts named threads that each call one pool method; their results go to a queue."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: queue.Queue[tuple[str, Any]] = queue.Queue()

    def start(self, name: str, call: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            self.results.put((name, call()))

        thread = threading.Thread(target=run, name=f"test-pool-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def result(self) -> tuple[str, Any]:
        """The next (name, result), failing the test when none comes within `PROMPT`."""
        try:
            return self.results.get(timeout=PROMPT)
        except queue.Empty:
            raise AssertionError(f"no thread returned within {PROMPT:g}s") from None

    def join(self, thread: threading.Thread) -> None:
        thread.join(PROMPT)
        assert not thread.is_alive(), f"{thread.name} still blocked after {PROMPT:g}s"


@pytest.fixture
def runner() -> Iterator[Runner]:
    r = Runner()
    yield r
    for thread in r.threads:
        thread.join(BLOCK + PROMPT)


@pytest.fixture
def make_pool(runner: Runner) -> Iterator[Callable[[int], ClaimPool[Any]]]:
    """Pools shut at the end of the test (before `runner` joins its threads)."""
    pools: list[ClaimPool[Any]] = []

    def make(capacity: int) -> ClaimPool[Any]:
        pools.append(ClaimPool(capacity))
        return pools[-1]

    yield make
    for p in pools:
        p.shut()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The pool's clock (the age of the head row), moved only by the test."""
    fake = FakeClock()
    monkeypatch.setattr(pool_module, "time", types.SimpleNamespace(monotonic=fake))
    return fake


# -- FIFO, bounds, timeouts ------------------------------------------------------------


def test_rows_come_out_in_the_order_they_went_in(make_pool):
    pool = make_pool(10)
    pool.put_many(["a", "b", "c"])
    pool.put_many(["d"])
    assert len(pool) == 4
    assert [pool.take(0) for _ in range(4)] == ["a", "b", "c", "d"]
    assert len(pool) == 0


def test_free_slots_are_the_capacity_less_the_buffered_rows(make_pool):
    pool = make_pool(5)
    assert pool.wait_for_space(5, BLOCK) == 5
    pool.put_many([1, 2])
    assert pool.wait_for_space(3, BLOCK) == 3  # enough space: returns at once
    pool.put_many([3, 4, 5])
    began = time.monotonic()
    assert pool.wait_for_space(1, 0.05) == 0  # full: waits its timeout, reports no space
    assert 0.04 <= time.monotonic() - began < PROMPT
    assert len(pool) == 5


def test_wait_for_space_reports_fewer_slots_than_wanted_after_its_timeout(make_pool):
    pool = make_pool(4)
    pool.put_many([1])
    began = time.monotonic()
    assert pool.wait_for_space(4, 0.05) == 3
    assert 0.04 <= time.monotonic() - began < PROMPT


def test_take_on_an_empty_pool_returns_none_after_its_timeout(make_pool):
    pool = make_pool(3)
    began = time.monotonic()
    assert pool.take(0.05) is None
    assert 0.04 <= time.monotonic() - began < PROMPT
    assert pool.take(0) is None


def test_a_waiting_taker_gets_a_row_put_later(make_pool, runner):
    pool = make_pool(3)
    taker = runner.start("taker", lambda: pool.take(BLOCK))
    wait_until(lambda: waiting_takers(pool) == 1, PROMPT, "the taker to block")
    pool.put_many(["row"])
    assert runner.result() == ("taker", "row")
    runner.join(taker)


# -- close, shut, drain, wake ----------------------------------------------------------------


def test_close_wakes_every_taker_and_returns_the_buffered_rows(make_pool, runner):
    pool = make_pool(5)
    takers = [runner.start(f"taker-{i}", lambda: pool.take(BLOCK)) for i in range(3)]
    wait_until(lambda: waiting_takers(pool) == 3, PROMPT, "three takers to block")
    assert pool.close() == []
    for thread in takers:
        runner.join(thread)
    assert sorted(runner.result() for _ in takers) == [(f"taker-{i}", None) for i in range(3)]
    assert pool.closed


def test_close_returns_what_is_buffered_in_order_and_hands_out_nothing_more(make_pool):
    pool = make_pool(5)
    pool.put_many(["a", "b", "c"])
    assert pool.take(0) == "a"
    assert pool.close() == ["b", "c"]
    assert len(pool) == 0
    pool.put_many(["late"])  # a fetch that raced the close
    assert pool.take(0) is None


def test_shut_wakes_takers_and_the_fetcher_but_keeps_the_rows_for_drain(make_pool, runner):
    pool = make_pool(2)
    pool.put_many(["a", "b"])
    fetcher = runner.start("fetcher", lambda: pool.wait_for_space(1, BLOCK))
    wait_until(lambda: waiting_fetchers(pool) == 1, PROMPT, "the fetcher to block")
    pool.shut()
    runner.join(fetcher)
    assert runner.result() == ("fetcher", 0)
    assert pool.take(0) is None  # shut: nothing handed out
    assert pool.drain() == ["a", "b"]


def test_drain_empties_the_pool_and_wakes_a_fetcher_waiting_for_space(make_pool, runner):
    pool = make_pool(3)
    pool.put_many(["a", "b", "c"])
    fetcher = runner.start("fetcher", lambda: pool.wait_for_space(3, BLOCK))
    wait_until(lambda: waiting_fetchers(pool) == 1, PROMPT, "the fetcher to block")
    assert pool.drain() == ["a", "b", "c"]
    runner.join(fetcher)
    assert runner.result() == ("fetcher", 3)
    assert len(pool) == 0 and not pool.closed
    pool.put_many(["d"])  # drained, not closed: rows flow again
    assert pool.take(0) == "d"


def test_wake_ends_waits_without_closing(make_pool, runner):
    pool = make_pool(1)
    taker = runner.start("taker", lambda: pool.take(BLOCK))
    wait_until(lambda: waiting_takers(pool) == 1, PROMPT, "the taker to block")
    pool.wake()
    runner.join(taker)
    assert runner.result() == ("taker", None)
    assert not pool.closed


# -- the fetcher waiting for space ------------------------------------------------------------


def test_wait_for_space_returns_when_takes_free_enough_slots(make_pool, runner):
    pool = make_pool(4)
    pool.put_many([1, 2, 3, 4])
    fetcher = runner.start("fetcher", lambda: pool.wait_for_space(2, BLOCK))
    wait_until(lambda: waiting_fetchers(pool) == 1, PROMPT, "the fetcher to block")
    assert pool.take(0) == 1
    # one slot is not enough: the fetcher still waits (it re-checks every few ms)
    with pytest.raises(queue.Empty):
        runner.results.get(timeout=0.1)
    assert fetcher.is_alive()
    assert pool.take(0) == 2
    runner.join(fetcher)
    assert runner.result() == ("fetcher", 2)


# -- lazy hand-off -------------------------------------------------------------------------------


def test_a_fresh_batch_wakes_one_worker_and_an_overdue_head_row_wakes_the_next(
    make_pool, runner, clock
):
    pool = make_pool(10)
    workers = {name: runner.start(name, lambda: pool.take(BLOCK)) for name in ("w1", "w2")}
    wait_until(lambda: waiting_takers(pool) == 2, PROMPT, "both workers to block")

    pool.put_many(["r1", "r2", "r3"])
    first, row = runner.result()
    assert row == "r1"
    runner.join(workers[first])
    # the head row had not waited HANDOFF_LAG when `first` took r1: the other sleeps on
    assert waiting_takers(pool) == 1 and len(pool) == 2

    clock.advance(HANDOFF_LAG)
    assert pool.take(0) == "r2"  # a busy worker takes again; r3 is now overdue
    second, row = runner.result()
    assert (second, row) == ({"w1", "w2"}.difference({first}).pop(), "r3")
    runner.join(workers[second])


def test_the_fetcher_waiting_for_space_wakes_a_worker_for_an_overdue_row(make_pool, runner, clock):
    pool = make_pool(2)
    workers = {name: runner.start(name, lambda: pool.take(BLOCK)) for name in ("w1", "w2")}
    wait_until(lambda: waiting_takers(pool) == 2, PROMPT, "both workers to block")
    pool.put_many(["r1", "r2"])
    first, row = runner.result()
    assert row == "r1"
    assert waiting_takers(pool) == 1 and len(pool) == 1  # lazy: r2 waits, w2 sleeps

    clock.advance(HANDOFF_LAG)
    # the fetcher wants the whole pool free; while it waits it wakes a worker for r2
    fetcher = runner.start("fetcher", lambda: pool.wait_for_space(2, BLOCK))
    got = dict(runner.result() for _ in range(2))
    assert got == {"fetcher": 2, {"w1", "w2"}.difference({first}).pop(): "r2"}
    runner.join(fetcher)
    for thread in workers.values():
        runner.join(thread)


def test_resize_hands_back_the_rows_above_the_new_bound_newest_first_out() -> None:
    pool: ClaimPool[int] = ClaimPool(8)
    pool.put_many(range(6))
    assert pool.resize(4) == [4, 5]  # the most recently claimed rows
    assert pool.capacity == 4 and len(pool) == 4
    assert pool.resize(10) == []
    assert [pool.take(0) for _ in range(4)] == [0, 1, 2, 3]
