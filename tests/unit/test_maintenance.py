"""The maintenance scheduler and the handler-timeout watchdog, without a database.

Nothing here opens a connection: the engine is never used, the tasks are plain
callables, and time comes from a fake clock.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

import pytest
from sqlalchemy import create_engine

from pgq.classify import make_classifier
from pgq.consumer.acker import Acker
from pgq.consumer.gate import Gate
from pgq.consumer.handling import Handling
from pgq.consumer.maintenance import Maintenance
from pgq.consumer.member import Member
from pgq.consumer.pool import ClaimPool
from pgq.consumer.workers import Workers
from pgq.errors import DatabaseUnavailable, LockNotAvailable, TransactionConflict
from pgq.records import Claimed, Lease, Message
from pgq.settings import Settings
from pgq.store import GroupStore, Link, MemberLinks

WAIT = 10.0
"""Bound on every wait for a real thread."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


ROLES = ("session", "claims", "work")


def member(handler=lambda m: None, **settings: object) -> Member:
    s = Settings(**settings)  # type: ignore[arg-type]
    return Member(
        links=MemberLinks(*(Link(create_engine("postgresql+psycopg://"), r) for r in ROLES)),
        settings=s,
        store=GroupStore(1, "g", "t", "me", s.lease, s.max_reclaims),
        handling=Handling(handler, make_classifier(None), s),
        topic_id=1,
        pool=ClaimPool(s.effective_prefetch),
    )


def row(mid: int = 1) -> Claimed:
    msg = Message(mid, "t", "g", None, {}, None, 1, dt.datetime.now(dt.timezone.utc))
    return Claimed(msg, Lease(mid, mid), attempts=0)


# -- the scheduler ------------------------------------------------------------------


def test_tasks_run_at_once_then_every_interval_in_the_order_added():
    clock = Clock()
    tasks = Maintenance(member(), clock)
    ran: list[str] = []
    tasks.add("a", 1.0, lambda: ran.append("a"))
    tasks.add("b", 3.0, lambda: ran.append("b"))
    assert tasks.run_due() == pytest.approx(1.0)
    assert ran == ["a", "b"]
    clock.now += 0.5
    assert tasks.run_due() == pytest.approx(0.5)
    assert ran == ["a", "b"]
    clock.now += 0.5
    assert tasks.run_due() == pytest.approx(1.0)
    assert ran == ["a", "b", "a"]
    clock.now += 2.0
    tasks.run_due()
    assert ran == ["a", "b", "a", "a", "b"]


def test_a_failing_task_logs_once_and_the_others_go_on(caplog):
    clock = Clock()
    tasks = Maintenance(member(), clock)
    ran: list[str] = []
    failures = [DatabaseUnavailable("down"), DatabaseUnavailable("down"), None]

    def flaky() -> None:
        exc = failures.pop(0)
        if exc is not None:
            raise exc
        ran.append("flaky")

    def broken() -> None:
        raise ValueError("bug")

    tasks.add("flaky", 1.0, flaky)
    tasks.add("broken", 1.0, broken)
    tasks.add("fine", 1.0, lambda: ran.append("fine"))
    with caplog.at_level(logging.INFO, logger="pgq.consumer"):
        for _ in range(3):
            tasks.run_due()
            clock.now += 1.0
    assert ran == ["fine", "fine", "flaky", "fine"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("task=flaky" in m and "failed" in m for m in messages) == 1
    assert sum("task=flaky" in m and "recovered" in m for m in messages) == 1
    assert sum("task=broken" in m and "failed" in m for m in messages) == 3
    assert all(t.failing == (t.name == "broken") for t in tasks.tasks)


def test_a_task_that_loses_a_lock_is_deferred_to_its_next_period_not_refused(caplog):
    """A housekeeping statement that gave up on a lock (`lock_timeout`): the task is
    tried again at its next period, the member goes on (no refusal, no traceback)."""
    clock = Clock()
    m = member()
    tasks = Maintenance(m, clock)
    failures = [LockNotAvailable("lock not available"), TransactionConflict("deadlock"), None]
    ran: list[str] = []

    def retention() -> None:
        exc = failures.pop(0)
        if exc is not None:
            raise exc
        ran.append("retention")

    tasks.add("retention", 60.0, retention)
    with caplog.at_level(logging.INFO, logger="pgq.consumer"):
        for _ in range(3):
            assert tasks.run_due() == pytest.approx(60.0)
            clock.now += 60.0
    assert ran == ["retention"] and not tasks.tasks[0].failing
    assert m.refused is None and not m.stopping.is_set()
    records = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
    assert [(level, exc_info) for level, _, exc_info in records] == [
        (logging.WARNING, None),
        (logging.INFO, None),
        (logging.INFO, None),
    ]
    assert "task=retention reason=lock_timeout group=g member=me" in records[0][1]
    assert "reason=conflict" in records[1][1]
    assert "maintenance task recovered task=retention" in records[2][1]


def test_a_task_is_due_again_one_interval_after_it_finished():
    clock = Clock()
    tasks = Maintenance(member(), clock)

    def slow() -> None:
        clock.now += 5.0  # the task itself takes five seconds

    tasks.add("slow", 2.0, slow)
    tasks.run_due()
    assert tasks.tasks[0].due == pytest.approx(107.0)


# -- the handler-timeout watchdog -----------------------------------------------------


def test_an_overdue_handler_is_failed_as_systemic_replaced_and_its_late_result_dropped():
    release = threading.Event()
    started = threading.Event()

    def handler(message: Message) -> None:
        started.set()
        assert release.wait(WAIT)

    clock = Clock()
    m = member(handler, workers=1, handler_timeout=30.0)
    gate = Gate(m.settings, clock)
    acker = Acker(m)  # not started: the outcomes stay in its queue for us to read
    workers = Workers(m, gate, acker, clock)
    workers.start()
    first = workers.threads[0]
    m.hold([row(7)])
    m.pool.put_many([row(7)])
    assert started.wait(WAIT)

    clock.now += 29.9
    workers.check_timeouts()
    assert acker.outcomes.empty() and workers.threads == [first]

    clock.now += 0.2
    workers.check_timeouts()
    outcome = acker.outcomes.get(timeout=WAIT)
    assert outcome is not None
    assert (outcome.claimed.id, outcome.kind, outcome.error_class) == (7, "retry", "systemic")
    assert outcome.error is not None and outcome.error.startswith("TimeoutError")
    assert len(workers.threads) == 1 and workers.threads[0] is not first
    assert workers.threads[0].is_alive()

    release.set()  # the abandoned handler returns now: its outcome must not be reported
    first.join(WAIT)
    assert not first.is_alive()
    assert acker.outcomes.empty()
    with m.lock:
        assert m.tally.handled == 1

    m.request_stop("signal")
    m.pool.shut()
    assert workers.join(time.monotonic() + WAIT) == []


def test_the_watchdog_spawns_no_replacement_while_stopping():
    release = threading.Event()
    started = threading.Event()

    def handler(message: Message) -> None:
        started.set()
        release.wait(WAIT)

    clock = Clock()
    m = member(handler, workers=1, handler_timeout=1.0)
    gate = Gate(m.settings, clock)
    workers = Workers(m, gate, Acker(m), clock)
    workers.start()
    m.pool.put_many([row(1)])
    assert started.wait(WAIT)
    m.request_stop("signal")
    clock.now += 2.0
    workers.check_timeouts()
    assert workers.threads == []
    release.set()
