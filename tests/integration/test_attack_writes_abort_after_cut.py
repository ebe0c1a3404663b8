"""Attack on the second signal's writes (`Runtime.abort`, decision 0039) after a cut.

Found by attack: `abort` writes the queued outcomes and releases the buffered rows
on the `claims` connection, one try each. When a cut (a TCP reset: a restarted
pooler, a failover, a network blip) broke that connection while it sat idle
(claiming stops at the first signal), the first statement meets the dead socket,
`DatabaseUnavailable` ends the whole abort, and nothing is tried on a fresh
connection though the database answers: the finished outcomes are lost (their
handlers run again once the lease ends) and the buffered rows stay leased for a
lease. Defect 12's test (`test_delivery_faults.py`) shows what abort must leave
behind; this is the same moment, with the cut.
"""

from __future__ import annotations

import threading

import pytest
from chaos.proxy import Proxy
from helpers import FAST, pin_frontier, rows, state_of, wait_until, waiting_on
from sqlalchemy import Engine, text

import pgq

pytestmark = pytest.mark.timeout(90)

WAIT = 30.0


def test_a_second_signal_after_a_cut_still_writes_and_releases(
    orders: Engine, pg_dsn: str, schema: str
) -> None:
    engine = orders
    pin_frontier(engine, "orders")
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(12)])
    blocker = engine.connect()  # direct, not through the proxy: the cut spares it
    tx = blocker.begin()
    blocker_pid = blocker.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    first_running, first_locked, gate = threading.Event(), threading.Event(), threading.Event()
    handled: list[int] = []

    def handler(message: pgq.Message) -> None:
        handled.append(message.id)
        if len(handled) == 1:
            first_running.set()
            assert first_locked.wait(WAIT)  # its outcome's write will wait on the lock
        elif len(handled) <= 3:
            wait_until(
                lambda: waiting_on(engine, blocker_pid, "WITH last AS%"),
                WAIT,
                "the first outcome's write to wait on the test's lock",
            )
        else:
            assert gate.wait(WAIT)

    with Proxy.for_dsn(pg_dsn) as proxy:
        through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
        consumer = pgq.Consumer(through, "billing", handler, workers=1, prefetch=4, **FAST)
        consumer.start()
        try:
            assert first_running.wait(WAIT)
            blocker.execute(
                text(f'SELECT 1 FROM "{schema}".delivery WHERE message_id = :id FOR UPDATE'),
                {"id": handled[0]},
            )
            first_locked.set()
            wait_until(lambda: len(handled) == 4, WAIT, "two outcomes queued, one handler running")
            leased = [mid for mid, r in rows(engine, "billing").items() if r.state == "leased"]
            buffered = [mid for mid in leased if mid not in handled]
            assert buffered
            proxy.cut()  # every connection of the member, the idle `claims` one too
            consumer.abort()
            # what a process exiting right after the second signal leaves behind
            found = rows(engine, "billing")
            finished = {mid: state_of(found, mid) for mid in handled[1:3]}
            assert finished == dict.fromkeys(handled[1:3], "done"), finished
            assert {mid: found[mid].state for mid in buffered} == dict.fromkeys(buffered, "ready")
        finally:
            gate.set()
            tx.rollback()
            blocker.close()
            consumer.stop(timeout=5)
            through.dispose()
