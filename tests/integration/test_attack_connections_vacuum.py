"""Outcomes while the member's VACUUM of `delivery` runs (decisions 0021, 0027).

Decision 0021 runs the member's VACUUM on a thread and connection of its own: a
VACUUM of a big or throttled table can take longer than the lease, and the
member's other work must go on meanwhile. Decision 0027 puts it on the `work`
link, with the acker's outcome writes and housekeeping, where it holds the
link's lock for as long as it runs. Found by attack: while a VACUUM runs, no
outcome is written (nor any sweep, frontier or handler-timeout check done): a
message handled at once stayed `leased` until the VACUUM was over (3.8 s for a
4 s VACUUM, against 0.03 s before), and the member stops claiming once its
unwritten outcomes fill its room. The long VACUUM is simulated as in
test_member_engine.py::test_leases_are_extended_while_a_vacuum_runs.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers import FAST, rows, state_of, wait_until
from sqlalchemy import Connection, Engine

import pgq

pytestmark = pytest.mark.timeout(60)

VACUUM = 4.0
"""Seconds the simulated VACUUM runs."""

WRITTEN = 1.5
"""Seconds a handled message may wait for its outcome to be written."""


def test_outcomes_are_written_while_a_vacuum_runs(
    orders: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgq.store.group import GroupStore

    engine = orders
    vacuum = GroupStore.vacuum_dead_rows
    vacuuming, over = threading.Event(), threading.Event()

    def slow_vacuum(self: GroupStore, conn: Connection) -> bool:
        vacuuming.set()
        over.wait(VACUUM)  # a big table's VACUUM
        return vacuum(self, conn)

    monkeypatch.setattr(GroupStore, "vacuum_dead_rows", slow_vacuum)
    handled: dict[int, float] = {}

    def handler(msg: pgq.Message) -> None:
        handled[msg.id] = time.monotonic()

    consumer = pgq.Consumer(engine, "billing", handler, name="m1", workers=2, **FAST)
    consumer.start()
    try:
        assert vacuuming.wait(20), "the member's first VACUUM check did not run"
        mid = pgq.publish(engine, "orders", {"n": 1})
        wait_until(lambda: mid in handled, 5, "the message to be handled")

        def state() -> str:  # a finished row may be gone: pruned behind the frontier
            return state_of(rows(engine, "billing"), mid)

        wait_until(
            lambda: state() == "done",
            WRITTEN,
            "the outcome of a message handled while a VACUUM runs to be written",
            describe=lambda: f"state {state()}, VACUUM still running: {not over.is_set()}",
        )
    finally:
        over.set()
        consumer.stop(timeout=10)
