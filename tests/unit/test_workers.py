"""Workers' batched hand-offs (decision 0028), with real threads and no database.

The acker is never started: what workers report stays in its queue, one list per
report, for the test to read. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time

from helpers import wait_until
from test_maintenance import Clock, member, row

from pgq.consumer.acker import Acker
from pgq.consumer.gate import Gate
from pgq.consumer.workers import CHUNK_BUDGET, MAX_CHUNK, SLOW, Pace, Workers
from pgq.records import Message, Outcome

WAIT = 10.0


def started(handler_blocks_on: dict[int, threading.Event], running: threading.Event):
    def handler(message: Message) -> None:
        gate = handler_blocks_on.get(message.id)
        if gate is not None:
            running.set()
            assert gate.wait(WAIT)

    return handler


def reports(acker: Acker) -> list[list[Outcome]]:
    """The lists workers have reported so far."""
    found = []
    while not acker.outcomes.empty():
        got = acker.outcomes.get_nowait()
        assert got is not None
        found.append(got)
    return found


def fast(workers: Workers, acker: Acker) -> None:
    """Make the one worker's handlers look fast already (they start out slow), and let
    it run one row so that its next take asks for that many (its first one, already
    waiting, asked for one row)."""
    (worker,) = workers.threads
    worker.pace.mean = CHUNK_BUDGET / 100
    warm = row(1000)
    worker.member.hold([warm])
    worker.member.pool.put_many([warm])
    wait_until(lambda: reports(acker), WAIT, "the warm-up row's outcome")


def test_the_pace_starts_at_one_row_grows_with_fast_handlers_and_falls_back_on_a_slow_one():
    pace = Pace()
    assert (pace.fast(), pace.chunk()) == (False, 1)
    for _ in range(40):
        pace.ran(0.00001)
    assert pace.fast() and pace.chunk() == MAX_CHUNK
    for _ in range(3):
        pace.ran(0.05)
    assert (pace.fast(), pace.chunk()) == (False, 1)


def test_fast_handlers_are_reported_in_lists_and_every_outcome_once():
    m = member(workers=2)
    acker = Acker(m)
    workers = Workers(m, Gate(m.settings, Clock()), acker, Clock())
    workers.start()
    seen: list[Outcome] = []
    lists: list[list[Outcome]] = []
    try:
        for start in range(0, 400, 20):  # as a fetcher does: batches, as room frees up
            batch = [row(i) for i in range(start + 1, start + 21)]
            m.hold(batch)
            m.pool.put_many(batch)
            wait_until(lambda: len(m.pool) == 0, WAIT, "the workers to take the batch")

        def collected() -> bool:
            got = reports(acker)
            lists.extend(got)
            seen.extend(o for batch in got for o in batch)
            return len(seen) == 400

        wait_until(collected, WAIT, "every outcome")
    finally:
        m.request_stop("signal")
        m.pool.shut()
        assert workers.join(time.monotonic() + WAIT) == []
    assert sorted(o.claimed.id for o in seen) == list(range(1, 401))
    assert all(o.kind == "done" for o in seen)
    assert max(len(batch) for batch in lists) > 1
    assert len(lists) < 400
    with m.lock:
        assert (m.tally.handled, m.tally.done, m.outcomes_pending) == (400, 400, 400)


def test_a_slow_row_does_not_hold_the_rows_its_worker_took_with_it():
    gate, running = threading.Event(), threading.Event()
    m = member(started({1: gate}, running), workers=1)
    acker = Acker(m)
    workers = Workers(m, Gate(m.settings, Clock()), acker, Clock())
    workers.start()
    fast(workers, acker)
    batch = [row(i) for i in range(1, 9)]
    m.hold(batch)
    m.pool.put_many(batch)
    try:
        assert running.wait(WAIT)
        assert len(m.pool) == 0  # the worker took them all at once

        def handed_back() -> bool:
            workers.check_timeouts()  # the watchdog's round (no handler is overdue)
            return len(m.pool) == 7

        wait_until(handed_back, SLOW * 200, "the rows taken with the slow one to go back")
        assert [r.id for r in m.pool.drain()] == list(range(2, 9))
    finally:
        gate.set()
        m.request_stop("signal")
        m.pool.shut()
        assert workers.join(time.monotonic() + WAIT) == []


def test_outcomes_kept_by_a_worker_are_reported_while_its_next_handler_runs_long():
    gate, running = threading.Event(), threading.Event()
    m = member(started({3: gate}, running), workers=1)
    acker = Acker(m)
    workers = Workers(m, Gate(m.settings, Clock()), acker, Clock())
    workers.start()
    fast(workers, acker)
    batch = [row(i) for i in range(1, 4)]
    m.hold(batch)
    m.pool.put_many(batch)
    seen: list[int] = []
    try:
        assert running.wait(WAIT)

        def reported() -> bool:
            workers.check_timeouts()
            seen.extend(o.claimed.id for got in reports(acker) for o in got)
            return sorted(seen) == [1, 2]

        wait_until(reported, WAIT, "the first two outcomes while the third runs")
    finally:
        gate.set()
        m.request_stop("signal")
        m.pool.shut()
        assert workers.join(time.monotonic() + WAIT) == []
    seen.extend(o.claimed.id for got in reports(acker) for o in got)
    assert sorted(seen) == [1, 2, 3]


def test_rows_a_worker_took_go_back_to_the_shut_pool_when_the_member_stops():
    gate, running = threading.Event(), threading.Event()
    m = member(started({1: gate}, running), workers=1)
    acker = Acker(m)
    workers = Workers(m, Gate(m.settings, Clock()), acker, Clock())
    workers.start()
    fast(workers, acker)
    batch = [row(i) for i in range(1, 6)]
    m.hold(batch)
    m.pool.put_many(batch)
    assert running.wait(WAIT)
    m.request_stop("signal")
    m.pool.shut()  # as the shutdown does: no worker starts another row
    gate.set()
    assert workers.join(time.monotonic() + WAIT) == []
    # started: only the first; the others wait in the shut pool for the final release
    assert [o.claimed.id for got in reports(acker) for o in got] == [1]
    assert [r.id for r in m.pool.drain()] == [2, 3, 4, 5]
