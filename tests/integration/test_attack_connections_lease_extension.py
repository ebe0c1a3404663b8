"""Lease extension while one of the member's rows is locked by an outside
transaction (an operator's `SELECT ... FOR UPDATE` or `UPDATE` left open), so the
acker's outcome write for that row waits on the `work` link.

Decision 0027 keeps lease extension on the `session` link so that it goes on
while an outcome write is stuck. Found by attack: it does not. The extension is
one statement over every lease the member holds, the stuck row's included; it
waits on that row's lock until its `lock_timeout` (a tenth of the lease) and
fails as a whole, every period, so the leases of the member's *other* rows, whose
handlers are still running, expire: another member reclaims them and runs those
messages a second time (reproduced with two members: every long-running message
ran twice). The same statement failed the same way before decision 0027.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers import FAST, wait_until, waiting_on
from sqlalchemy import Engine, text

import pgq

pytestmark = pytest.mark.timeout(90)

LEASE = 2.0


def test_a_row_locked_by_an_outside_transaction_does_not_stop_the_other_leases(
    orders: Engine, schema: str
) -> None:
    engine = orders
    stuck = pgq.publish(engine, "orders", {"stuck": True})
    stuck_running, stuck_go, long_go = threading.Event(), threading.Event(), threading.Event()
    started: set[int] = set()

    def handler(msg: pgq.Message) -> None:
        if msg.payload.get("stuck"):
            stuck_running.set()
            assert stuck_go.wait(30)
            return
        started.add(msg.id)
        assert long_go.wait(30)  # a handler that runs for several leases

    consumer = pgq.Consumer(
        engine, "billing", handler, name="m1", workers=4, lease=LEASE, prefetch=4, **FAST
    )
    blocker = engine.connect()
    tx = blocker.begin()
    blocker_pid = blocker.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    consumer.start()
    try:
        assert stuck_running.wait(30)
        blocker.execute(
            text(f'SELECT 1 FROM "{schema}".delivery WHERE message_id = :id FOR UPDATE'),
            {"id": stuck},
        )
        running = pgq.publish_many(engine, "orders", [{"long": n} for n in range(2)])
        wait_until(lambda: started >= set(running), 20, "the long handlers to start")
        stuck_go.set()  # its outcome is written now: the write waits on our lock
        # the ack's statement opens with its `last` CTE (pg_stat_activity cuts the text
        # at 1 kB, before the `state` it sets)
        wait_until(
            lambda: waiting_on(engine, blocker_pid, "WITH last AS%"),
            20,
            "the acker's outcome write to wait on the test's row lock",
        )

        def leases_left() -> dict[int, float | None]:
            with engine.connect() as conn:
                found = conn.exec_driver_sql(
                    "SELECT message_id, extract(epoch FROM lease_expires_at - now()),"
                    f' lease_owner FROM "{schema}".delivery'
                    " WHERE message_id = ANY(%(ids)s)",
                    {"ids": running},
                ).all()
            return {mid: (left if owner == "m1" else None) for mid, left, owner in found}

        # the long handlers run on: their leases must stay ahead for three leases
        deadline = time.monotonic() + 3 * LEASE
        while time.monotonic() < deadline:
            left = leases_left()
            assert all(x is not None and x > 0 for x in left.values()), (
                f"a running handler's lease expired while another row was locked: {left}"
            )
            time.sleep(0.1)
    finally:
        long_go.set()
        stuck_go.set()
        tx.rollback()
        blocker.close()
        consumer.stop(timeout=10)
