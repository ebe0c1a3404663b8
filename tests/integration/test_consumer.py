"""`pgq.Consumer` embedded in the test process, against a real server.

Each test drives real consumer threads (fetcher, workers, acker, maintenance)
with short settings and waits on conditions with deadlines, never on sleeps.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from collections import defaultdict
from typing import Any

from helpers import FAST, pin_frontier, rows, states, wait_for_frontier, wait_until
from sqlalchemy import Engine

import pgq


def consumer(engine: Engine, handler: Any, **settings: Any) -> pgq.Consumer:
    """A consumer of `billing` with the fast test settings, overridable."""
    return pgq.Consumer(
        engine, "billing", handler, **{"workers": 2, "lease": 2.0, **FAST, **settings}
    )


def state_of(engine: Engine, mid: int) -> str | None:
    row = rows(engine, "billing").get(mid)
    return None if row is None else row.state


# -- 2. out-of-order commits ------------------------------------------------------


def test_a_later_commit_is_delivered_at_once_but_the_frontier_waits_for_the_open_one(orders):
    seen: list[int] = []
    with orders.connect() as held:
        held.begin()
        first = pgq.publish(held, "orders", {"n": 1})  # not committed yet
        second = pgq.publish(orders, "orders", {"n": 2})
        assert second > first

        summary = consumer(orders, lambda m: seen.append(m.id)).run(until_empty=True)
        assert seen == [second]
        assert (summary.done, summary.stop_reason) == (1, "empty")
        status = pgq.status(orders, "billing")
        # a run returns with the frontier current: it must not pass the open transaction
        assert status["committed"] is None or status["committed"] < first
        assert status["counts"]["done"] == 1

        c = consumer(orders, lambda m: seen.append(m.id))
        c.start()
        try:
            held.commit()
            wait_until(lambda: first in seen, 10, "the late commit to be handled")
            wait_for_frontier(orders, "billing", max(first, second))
        finally:
            c.stop()
    assert sorted(seen) == [first, second]
    status = pgq.status(orders, "billing")
    assert (status["counts"]["done"], status["lag"]) == (2, 0)


# -- 3. RetryLater --------------------------------------------------------------------


def test_retry_later_snoozes_without_charging_an_attempt(orders):
    delay = 1.0
    calls: list[tuple[float, int]] = []

    def handler(msg: pgq.Message) -> None:
        calls.append((time.monotonic(), msg.attempt))
        if len(calls) == 1:
            raise pgq.RetryLater(delay)

    pin_frontier(orders, "orders")  # keep the done row readable
    mid = pgq.publish(orders, "orders", {"n": 1})
    c = consumer(orders, handler, workers=1)
    c.start()
    try:
        # called (so claimed) first, then ready again: the snooze was written
        snoozed = wait_until(
            lambda: calls and (r := rows(orders, "billing")[mid]).state == "ready" and r,
            10,
            "the snooze to be written",
        )
        assert snoozed.attempts == 0
        assert snoozed.error_class is None
        assert snoozed.available_at - snoozed.updated_at >= dt.timedelta(seconds=delay)
        wait_until(lambda: state_of(orders, mid) == "done", 10, "the second delivery")
    finally:
        summary = c.stop()
    assert len(calls) == 2
    assert calls[1][0] - calls[0][0] >= delay
    assert [attempt for _, attempt in calls] == [1, 1]  # the snooze was not an attempt
    done = rows(orders, "billing")[mid]
    assert (done.attempts, done.reclaims) == (1, 0)
    assert (summary.handled, summary.done, summary.retried) == (1, 1, 1)


# -- 4. failures, dead letters and backoff --------------------------------------------


def test_failures_retry_with_growing_backoff_then_die(orders):
    base, max_attempts = 0.2, 4
    calls: dict[int, list[tuple[float, int]]] = defaultdict(list)

    def handler(msg: pgq.Message) -> None:
        calls[msg.id].append((time.monotonic(), msg.attempt))
        if msg.payload["kind"] == "permanent":
            raise pgq.PermanentError("cannot ever work")
        raise ValueError("bad payload")

    plain = pgq.publish(orders, "orders", {"kind": "plain"})
    permanent = pgq.publish(orders, "orders", {"kind": "permanent"})
    c = consumer(orders, handler, max_attempts=max_attempts, retry_backoff=base, poll_interval=0.05)
    c.start()
    try:
        wait_until(
            lambda: state_of(orders, plain) == "dead" and state_of(orders, permanent) == "dead",
            15,
            "both messages to be dead",
        )
    finally:
        summary = c.stop()

    found = rows(orders, "billing")
    assert (found[plain].attempts, found[plain].error_class) == (max_attempts, "message")
    assert found[plain].last_error == "ValueError: bad payload"
    assert (found[permanent].attempts, found[permanent].error_class) == (1, "permanent")
    assert [a for _, a in calls[plain]] == [1, 2, 3, 4]
    assert [a for _, a in calls[permanent]] == [1]
    assert (summary.handled, summary.dead, summary.retried) == (5, 2, 3)

    times = [at for at, _ in calls[plain]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # each gap is the backoff, min(max, base × 2^(n−1)) × uniform(0.5, 1), plus the
    # outcome's write and the next claim: so at least half the full backoff (which
    # grows: the third is at least 0.4 s, more than the first can be without the
    # overhead), and at most the full one plus slack for a loaded machine (the first
    # gap, at a member's start, once took 0.65 s: comparing it with the third was a
    # comparison of overheads)
    for n, gap in enumerate(gaps, start=1):
        full = base * 2 ** (n - 1)
        assert full * 0.5 <= gap <= full + 0.6, (n, gaps)


# -- 9. lease extension ---------------------------------------------------------------


def test_a_handler_longer_than_the_lease_keeps_its_rows(orders):
    lease = 1.0
    handled: list[tuple[str, int]] = []
    lock = threading.Lock()

    def make(name: str) -> Any:
        def handler(msg: pgq.Message) -> None:
            time.sleep(3 * lease)
            with lock:
                handled.append((name, msg.id))

        return handler

    pin_frontier(orders, "orders")  # keep the done rows readable
    ids = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])
    members = [
        consumer(orders, make(name), name=name, lease=lease, workers=2) for name in ("a", "b")
    ]
    for c in members:
        c.start()
    try:
        wait_until(lambda: len(handled) == 2, 15, "both handlers to finish")
        # one member may have run both: its ack deleted one row, marked the other done
        wait_until(
            lambda: pgq.status(orders, "billing")["counts"]["done"] == 2, 5, "both rows done"
        )
    finally:
        for c in members:
            c.stop()
    assert sorted(mid for _, mid in handled) == ids  # each exactly once
    kept = [r for mid, r in rows(orders, "billing").items() if mid in ids]
    assert kept  # a batch keeps its last row (pinned: not pruned)
    assert [(r.state, r.attempts, r.reclaims) for r in kept] == [("done", 1, 0)] * len(kept)
    assert pgq.status(orders, "billing")["totals"]["reclaimed"] == 0


# -- embedded use ---------------------------------------------------------------------


def test_consumer_as_a_context_manager_handles_what_is_published_meanwhile(orders):
    seen: list[int] = []
    with consumer(orders, lambda m: seen.append(m.id), name="embedded") as c:
        ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(20)])
        wait_until(lambda: len(seen) >= 20, 10, "every message to be handled")
        assert c.snapshot().done == 20
    assert sorted(seen) == ids
    status = pgq.status(orders, "billing")
    assert (status["counts"]["done"], status["lag"]) == (20, 0)
    [member] = status["members"]
    assert member["name"] == "embedded" and not member["live"]  # it left the group


def test_an_idle_consumer_wakes_on_notify_and_stops_promptly(orders):
    poll, grace = 30.0, 10.0
    seen: list[int] = []
    c = consumer(orders, lambda m: seen.append(m.id), poll_interval=poll, shutdown_grace=grace)
    c.start()
    try:
        for n in range(3):
            mid = pgq.publish(orders, "orders", {"n": n})  # the first one right after start()
            # well short of the poll interval: only a NOTIFY wakes it this soon
            wait_until(lambda mid=mid: mid in seen, poll / 3, "a NOTIFY to wake the idle fetcher")
    finally:
        started = time.monotonic()
        summary = c.stop()
    assert time.monotonic() - started < grace / 2  # neither the poll interval nor the grace
    assert c.clean
    assert (summary.done, summary.stop_reason) == (3, "signal")


def test_max_messages_stops_after_that_many_finished_attempts(orders):
    def handler(msg: pgq.Message) -> None:
        if msg.payload["n"] % 3 == 0:
            raise ValueError("every third fails")

    pin_frontier(orders, "orders")  # keep the done rows readable
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(30)])
    summary = consumer(orders, handler, workers=3, max_attempts=5).run(max_messages=5)
    assert summary.stop_reason == "max_messages"
    assert summary.handled == summary.done + summary.retried == 5
    # the ack deleted most done rows: their attempts are the group's done count
    status = pgq.status(orders, "billing")
    assert status["counts"]["done"] == summary.done
    found = rows(orders, "billing").values()
    assert sum(r.attempts for r in found if r.state != "done") == summary.retried
    assert states(orders, "billing")["leased"] == 0
    assert status["totals"]["reclaimed"] == 0


def test_max_runtime_stops_gracefully(orders):
    def handler(msg: pgq.Message) -> None:
        time.sleep(0.05)

    n = 1_000
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(n)])
    started = time.monotonic()
    summary = consumer(orders, handler, workers=2).run(max_runtime=1.0)
    elapsed = time.monotonic() - started
    assert summary.stop_reason == "max_runtime"
    # the whole backlog takes n × 0.05 s / 2 workers = 25 s: a run that overstays its
    # runtime by more than a loaded machine's shutdown is not stopping at it
    assert 1.0 <= elapsed < 10.0
    status = pgq.status(orders, "billing")
    assert status["counts"]["leased"] == 0
    assert 0 < status["counts"]["done"] == summary.done < n
    assert status["counts"]["ready"] == n - summary.done
    for row in rows(orders, "billing").values():
        if row.state == "ready":
            assert (row.attempts, row.reclaims) == (0, 0)
    assert status["totals"]["released"] == summary.released
