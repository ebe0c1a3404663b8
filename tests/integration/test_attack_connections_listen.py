"""LISTEN on the shared session connection after that session was cut (decision 0027).

The member's `session` link carries its liveness lock, the heartbeat and LISTEN.
When the server ends that backend (`pg_terminate_backend`, a failover, an idle
limit), the heartbeat opens a new session within a beat and LISTEN is set up on
it again (`Link.on_connect`). An idle fetcher must hear publishes on the new
session at once. Found by attack: the listener noticed the cut first (its
`select` wakes on the server's FATAL message), threw the connection away and
then slept for the whole `poll_interval` without listening, so every publish
during the next `poll_interval` (30 s here) waited for the poll. The listener
of the old design (a connection of its own) reconnected on the fetcher's next
turn.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from helpers import wait_until
from sqlalchemy import Engine

import pgq
from pgq.store import conninfo_of

pytestmark = pytest.mark.timeout(90)

POLL = 30.0
"""A poll interval far longer than the test waits: only a NOTIFY can wake the fetcher."""

PICKUP = 5.0
"""Seconds a publish may take to be handled by an idle member that LISTENs."""


def _session_pids(engine: Engine, name: str) -> list[int]:
    with psycopg.connect(conninfo_of(engine), autocommit=True) as conn:
        found = conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = %s",
            (name,),
        ).fetchall()
    return [pid for (pid,) in found]


def _holds_advisory_lock(engine: Engine, pid: int) -> bool:
    with psycopg.connect(conninfo_of(engine), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND granted",
            (pid,),
        ).fetchone()
    return bool(row and row[0])


def test_an_idle_member_hears_publishes_again_once_its_session_was_cut(orders: Engine) -> None:
    engine = orders
    handled: dict[int, float] = {}
    seen = threading.Condition()

    def handler(msg: pgq.Message) -> None:
        with seen:
            handled[msg.id] = time.monotonic()
            seen.notify_all()

    consumer = pgq.Consumer(
        engine,
        "billing",
        handler,
        name="m1",
        workers=2,
        poll_interval=POLL,
        breaker_heartbeat=1.0,
        breaker_member_ttl=10.0,
    )
    consumer.start()
    try:
        session = "pgq/billing/m1/session"
        (first,) = wait_until(lambda: _session_pids(engine, session), 10, "the session backend")

        # idle and listening: a publish is handled at once (no poll within 30 s)
        mid = pgq.publish(engine, "orders", {"n": 0})
        wait_until(lambda: mid in handled, PICKUP, "the first publish to be handled")

        with psycopg.connect(conninfo_of(engine), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (first,))

        # the heartbeat opens a new session (LISTEN runs on it) and retakes the
        # member's liveness lock there
        def new_session() -> int | None:
            pids = [p for p in _session_pids(engine, session) if p != first]
            return pids[0] if pids and _holds_advisory_lock(engine, pids[0]) else None

        second = wait_until(new_session, 10, "a new session holding the liveness lock")
        assert first not in _session_pids(engine, session)

        published = time.monotonic()
        mid = pgq.publish(engine, "orders", {"n": 1})
        wait_until(
            lambda: mid in handled,
            PICKUP,
            f"a publish after the session was cut (new session pid {second}) to be handled"
            f" by an idle member with poll_interval={POLL:g}s",
        )
        assert handled[mid] - published < PICKUP
    finally:
        consumer.stop(timeout=10)
