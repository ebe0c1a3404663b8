"""A graceful stop while an outcome write waits on an operator's row lock
(decision 0027: acker, housekeeping and VACUUM share the `work` link).

Found by attack:

- `Link.close` cancels the stuck write after 1 s, and the acker takes the
  cancellation (`QueryCanceled`, not an outage) for the database refusing the
  outcome: it writes a replacement *failure* ("pgq could not record the outcome:
  statement cancelled") for a handler that succeeded. That write waits on the
  same lock and, an autocommit statement, commits as soon as the operator's
  transaction ends, even after the process has exited: the message is charged an
  attempt and runs again. The old design left the write to finish: `done`.
- The stop takes twice as long: the maintenance thread waits on the link's lock
  behind the stuck write until its 5 s join gives up, then closing the link waits
  1 s, cancels and waits 1 s more. Measured with `shutdown_grace` 2 s: 14 s
  (`pgq consume` on SIGTERM too), against 7 s before the change.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from helpers import FAST, pin_frontier, rows, wait_until, waiting_on
from sqlalchemy import Connection, Engine, RootTransaction, text

import pgq
from pgq.store import conninfo_of

pytestmark = pytest.mark.timeout(90)

GRACE = 1.0
SLACK = 7.0
"""Seconds past `shutdown_grace` a stop with one outcome write stuck may take: the
acker's own joins (grace, then 5 s once database retries are halted), with room
to spare; before decision 0027 such a stop took grace + 5 s."""


def _member_backends(engine: Engine, member: str) -> list[tuple[str, str, str | None]]:
    with psycopg.connect(conninfo_of(engine), autocommit=True) as conn:
        return conn.execute(
            "SELECT application_name, state, wait_event_type FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE %s",
            (f"pgq/billing/{member}/%",),
        ).fetchall()


def _stuck_write(
    engine: Engine, schema: str
) -> tuple[pgq.Consumer, Connection, RootTransaction, int]:
    """Start member m1, let its one message succeed while the test holds the row's
    lock, and wait until the acker's write waits on it; returns (consumer, blocker
    connection, its transaction, message id)."""
    pin_frontier(engine, "orders")  # keeps a done row from being pruned
    mid = pgq.publish(engine, "orders", {"n": 1})
    running, go = threading.Event(), threading.Event()

    def handler(msg: pgq.Message) -> None:
        running.set()
        assert go.wait(30)

    consumer = pgq.Consumer(engine, "billing", handler, name="m1", workers=2, **FAST)
    consumer.start()
    blocker = engine.connect()
    tx = blocker.begin()
    pid = blocker.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    assert running.wait(30)
    blocker.execute(
        text(f'SELECT 1 FROM "{schema}".delivery WHERE message_id = :id FOR UPDATE'), {"id": mid}
    )
    go.set()
    # the ack opens with its `last` CTE; pg_stat_activity keeps only the first kB of
    # a statement (track_activity_query_size), which holds no `state`
    wait_until(
        lambda: waiting_on(engine, pid, "WITH last AS%"),
        20,
        "the acker's outcome write to wait on the test's row lock",
    )
    return consumer, blocker, tx, mid


def test_a_success_whose_write_is_stuck_at_shutdown_is_not_recorded_as_a_failure(
    orders: Engine, schema: str
) -> None:
    engine = orders
    consumer, blocker, tx, mid = _stuck_write(engine, schema)
    try:
        consumer.stop(timeout=GRACE)
    finally:
        tx.rollback()  # the operator's transaction ends
        blocker.close()

    # whatever the member left running on the row finishes now that the lock is gone
    def settled() -> bool:
        ackers = [t for t in threading.enumerate() if t.name == "pgq-acker"]
        active = [b for b in _member_backends(engine, "m1") if b[1] == "active"]
        return not ackers and not active

    wait_until(
        settled,
        10,
        "the member's acker and statements to finish",
        describe=lambda: _member_backends(engine, "m1"),
    )
    row = rows(engine, "billing")[mid]
    # done (the write went through), or left leased for a reclaim: never a failure the
    # handler did not raise
    assert row.error_class is None, (row.state, row.attempts, row.last_error)
    assert row.state in ("done", "leased"), (row.state, row.attempts, row.last_error)


def test_a_stop_with_an_outcome_write_stuck_ends_within_the_grace_and_a_few_seconds(
    orders: Engine, schema: str
) -> None:
    engine = orders
    consumer, blocker, tx, _ = _stuck_write(engine, schema)
    try:
        started = time.monotonic()
        consumer.stop(timeout=GRACE)
        took = time.monotonic() - started
    finally:
        tx.rollback()
        blocker.close()
    assert took <= GRACE + SLACK, f"stop(timeout={GRACE:g}) took {took:.1f}s"
