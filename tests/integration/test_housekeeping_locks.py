"""Housekeeping stuck behind a lock never stops lease extension (issue 20, defect 1).

A caller's transaction that holds a topic (a `subscribe(start="earliest")` left
open) makes retention's `FOR KEY SHARE` on the topic row wait. Retention ran on
the maintenance thread, which also extended the member's leases: while it waited
no lease was extended, other members reclaimed rows whose handlers still ran,
and messages ran two and three times. Leases are now extended on the heartbeat's
thread and connection, and housekeeping statements give up on a lock after
`HOUSEKEEPING_LOCK_TIMEOUT` and try again at their next period (decision 0025).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest
from helpers import FAST, rows, wait_until
from sqlalchemy import Engine, func, select, text, update

import pgq
from pgq import schema as t
from pgq.consumer import runtime
from pgq.errors import DatabaseUnavailable, LockNotAvailable, TransactionConflict
from pgq.store import RoleConnection
from pgq.store.group import GroupStore

LEASE = 2.0
"""The member's lease: extended every 2/3 s, so an expired lease means nobody
extended it for at least 1.3 s."""

HOLD = 4 * LEASE
"""How long the caller keeps the topic locked while the handlers run."""

MESSAGES = 4


class Held:
    """A handler that counts each message's runs and holds it until `release` is set
    (several leases); with `poison`, messages whose payload says so fail as systemic."""

    def __init__(self, *, poison: bool = False) -> None:
        self.runs: Counter[int] = Counter()
        self.release = threading.Event()
        self.poison = poison
        self._lock = threading.Lock()

    def __call__(self, msg: pgq.Message) -> None:
        with self._lock:
            self.runs[msg.id] += 1
        if self.poison and msg.payload.get("poison"):
            raise ConnectionError("the dependency is down")  # systemic: trips the member
        assert self.release.wait(60)


def topic_messages(engine: Engine, topic: str) -> int:
    """How many messages `topic` still holds."""
    m, tp = t.message, t.topic
    with engine.connect() as conn:
        count = select(func.count()).select_from(m.join(tp, tp.c.id == m.c.topic_id))
        return int(conn.execute(count.where(tp.c.name == topic)).scalar_one())


def blocked_by(engine: Engine, pid: int, query_like: str) -> bool:
    """Whether a backend running a statement `LIKE query_like` waits for a lock
    that backend `pid` holds."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE CAST(:pid AS int) = ANY(pg_blocking_pids(pid)) AND query LIKE :like"
            ),
            {"pid": pid, "like": query_like},
        ).scalar_one()
    return bool(found)


def test_leases_are_extended_while_retention_waits_for_a_callers_subscribe(
    engine: Engine, schema: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Member m1 runs every message (handlers longer than the lease) and its
    retention pass waits for a caller's open `subscribe`; member m2, idle, sweeps
    expired leases meanwhile. Before: m1 extended no lease while retention waited,
    m2 reclaimed every row and ran it again. Now m1's leases stay alive, nothing is
    reclaimed, and retention runs once the caller's transaction ends."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(MESSAGES)])
    with engine.begin() as conn:  # an hour old: retention's once the group is done
        conn.execute(
            update(t.message)
            .where(t.message.c.id.in_(ids))
            .values(created_at=func.now() - text("interval '1 hour'"))
        )

    held = Held()
    runs, release, handler = held.runs, held.release, held

    expire = GroupStore.expire_messages
    m2_expired = threading.Event()

    def expire_messages(self: GroupStore, *args: object, **kwargs: object) -> int:
        deleted = expire(self, *args, **kwargs)  # type: ignore[arg-type]
        if self.member == "m2":
            m2_expired.set()
        return deleted

    monkeypatch.setattr(GroupStore, "expire_messages", expire_messages)
    settings = {**FAST, "workers": MESSAGES, "lease": LEASE, "retention": 60.0}
    m1 = pgq.Consumer(engine, "g", handler, name="m1", **settings)  # type: ignore[arg-type]
    m2 = pgq.Consumer(engine, "g", handler, name="m2", **settings)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="pgq.consumer")
    caller = engine.connect()
    subscribing = caller.begin()
    try:
        monkeypatch.setattr(runtime, "RETENTION_EVERY", 2.0)  # m1: a pass every 2 s
        m1.start()
        wait_until(lambda: len(runs) == MESSAGES, 30, "m1 running every message")
        monkeypatch.setattr(runtime, "RETENTION_EVERY", 3600.0)  # m2: its start-up pass
        m2.start()
        assert m2_expired.wait(30), "m2's start-up retention pass"
        pgq.subscribe(caller, "late", "t", start="earliest")  # holds topic t until it ends
        caller_pid = caller.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        wait_until(
            lambda: blocked_by(engine, caller_pid, "%FOR KEY SHARE%"),
            30,
            "m1's retention pass waiting for the caller's lock",
        )
        left: list[float] = []
        deadline = time.monotonic() + HOLD
        while time.monotonic() < deadline:  # the caller keeps its transaction open
            with engine.connect() as conn:
                least = conn.execute(
                    select(
                        func.min(func.extract("epoch", t.delivery.c.lease_expires_at - func.now()))
                    )
                    .join(t.consumer_group, t.consumer_group.c.id == t.delivery.c.group_id)
                    .where(t.consumer_group.c.name == "g", t.delivery.c.state == "leased")
                ).scalar()
            left.append(-1.0 if least is None else float(least))
            time.sleep(0.1)
        assert min(left) > 0, f"a lease expired while the caller held the topic: {left}"
        deferred = [r.getMessage() for r in caplog.records if "task=retention" in r.getMessage()]
        assert any("deferred" in m and "reason=lock_timeout" in m for m in deferred), deferred

        subscribing.rollback()  # the caller gives up: the topic is free
        release.set()
        wait_until(
            lambda: all(r.state == "done" for r in rows(engine, "g").values()),
            30,
            "every message done",
            describe=lambda: rows(engine, "g"),
        )
        wait_until(
            lambda: topic_messages(engine, "t") == 0,
            30,
            "m1's retention deleting the finished messages once the lock is gone",
        )
    finally:
        release.set()
        if subscribing.is_active:
            subscribing.rollback()
        caller.close()
        m2.stop(timeout=30)
        m1.stop(timeout=30)
    assert runs == dict.fromkeys(ids, 1), runs
    assert pgq.status(engine, "g")["totals"]["reclaimed"] == 0


def test_a_housekeeping_statement_gives_up_on_a_held_lock(engine: Engine) -> None:
    """On a connection with a lock timeout, retention behind a caller's open
    `subscribe` fails within the timeout as `LockNotAvailable` (a conflict: try
    again later), not as an outage nor a refusal, and the connection stays usable."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    with engine.connect() as conn:
        gid, topic_id = conn.execute(
            select(t.consumer_group.c.id, t.consumer_group.c.topic_id).where(
                t.consumer_group.c.name == "g"
            )
        ).one()
    store = GroupStore(gid, "g", "t", "m", 30.0, 3)
    role = RoleConnection(engine, "maintenance", threading.Event(), lock_timeout=0.2)
    try:
        with engine.connect() as caller, caller.begin():
            pgq.subscribe(caller, "late", "t", start="earliest")
            started = time.monotonic()
            with pytest.raises(LockNotAvailable) as caught:
                role.run(store.expire_messages, topic_id, 60.0)
            assert time.monotonic() - started < 5.0
        assert isinstance(caught.value, TransactionConflict)
        assert not isinstance(caught.value, DatabaseUnavailable)
        assert "lock timeout" in str(caught.value)
        assert role.run(store.expire_messages, topic_id, 60.0) == 0  # free: it runs
    finally:
        role.close()


def test_leases_are_extended_while_the_quorum_flip_meets_a_held_breaker_row(
    engine: Engine, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat also extends the leases (above), so none of its statements may
    wait long: a member whose local breaker tripped tries the quorum flip at every
    beat, and a session holding the group's breaker row (a purge, a member stopped
    mid-flip) made that flip wait with no limit. Before: its two running handlers
    (three leases long) lost their leases and another member would run them again.
    Now the flip gives up after its lock timeout and is tried at the next beat."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    slow = pgq.publish_many(engine, "t", [{"sleep": True}] * 2)
    pgq.publish_many(engine, "t", [{"poison": True}] * 6)
    held = Held(poison=True)
    runs, release, handler = held.runs, held.release, held

    settings = {
        **FAST,
        "lease": LEASE,
        "breaker_min_members": 1,  # a local trip is a group trip: the heartbeat flips
        "breaker_window": 4,
        "breaker_min_calls": 2,
        "retry_backoff": 5.0,
    }
    member = pgq.Consumer(engine, "g", handler, name="m1", **settings)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="pgq.breaker")
    holder = engine.connect()
    holding = holder.begin()
    try:
        holder.execute(select(t.breaker).with_for_update())
        holder_pid = holder.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        member.start()
        wait_until(
            lambda: all(runs[mid] for mid in slow) and "heartbeat deferred" in caplog.text,
            30,
            "the slow handlers to run and the quorum flip to meet the held row",
            describe=lambda: (dict(runs), blocked_by(engine, holder_pid, "%breaker%")),
        )
        deadline = time.monotonic() + HOLD
        while time.monotonic() < deadline:  # the breaker row stays held meanwhile
            found = rows(engine, "g")
            assert all(found[mid].state == "leased" for mid in slow), found
            with engine.connect() as conn:
                expired = conn.execute(
                    select(func.count())
                    .select_from(t.delivery)
                    .where(
                        t.delivery.c.message_id.in_(slow),
                        t.delivery.c.lease_expires_at < func.now(),
                    )
                ).scalar_one()
            assert expired == 0, "a lease expired while the flip met the held row"
            time.sleep(0.1)  # a sampling period, not a wait for an event
    finally:
        holding.rollback()
        holder.close()
        release.set()
    summary = member.stop(timeout=30)
    assert summary.reclaimed == 0, summary
    assert [runs[mid] for mid in slow] == [1, 1]
