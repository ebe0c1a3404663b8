"""One misclassified poison row in a one-member group (issue 20, defect 2; DESIGN §6).

With `breaker.min_members = 1` a local trip is a group trip, so the poison row
alone (its handler raises `ConnectionError` for it and nothing else) can open
the group again after every close. A real `pgq.Consumer` on the real database
runs through an outage (a flag its handler reads) until every row is dead, then
the dependency comes back. Before the fix the group was reopened by the poison
row, which was then its only probe candidate: probed for good (35 probes in
24 s), its attempts far past `max_attempts`, its refunds under the cap, the
group OPEN. Now each failed probe of the row after a close had refunded it
spends a refund, and an OPEN group with nothing left to probe closes
(decision 0026). Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from helpers import LONE_OUTAGE, rows, wait_until
from sqlalchemy import Engine

import pgq
from pgq import monitor

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 2
MAX_REFUNDS = 3


def breaker(engine: Engine) -> dict:
    return dict(pgq.status(engine, "g")["breaker"])


@pytest.mark.parametrize("poison_first", [True, False], ids=["poison-oldest", "poison-newest"])
def test_a_poison_row_does_not_hold_a_one_member_group_open(engine, poison_first):
    """Oldest, the poison row is the local probe after each close (local probe path);
    newest, its own two failures trip the member's window (window path)."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    if poison_first:
        poison = pgq.publish(engine, "t", {"cursed": True})
        normal = pgq.publish_many(engine, "t", [{"i": i} for i in range(6)])
    else:
        normal = pgq.publish_many(engine, "t", [{"i": i} for i in range(6)])
        poison = pgq.publish(engine, "t", {"cursed": True})
    down = threading.Event()
    down.set()
    done: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(msg: pgq.Message) -> None:
        if msg.payload.get("cursed"):
            raise ConnectionError("misclassified poison")
        if down.is_set():
            raise ConnectionError("dependency down")
        with lock:
            done[msg.id] += 1

    settings = {**LONE_OUTAGE, "max_attempts": MAX_ATTEMPTS, "breaker_max_refunds": MAX_REFUNDS}
    consumer = pgq.Consumer(engine, "g", handler, **settings)
    consumer.start()
    most_attempts = 0

    def poison_row():
        nonlocal most_attempts
        row = rows(engine, "g")[poison]
        most_attempts = max(most_attempts, row.attempts)
        return row

    try:
        wait_until(
            lambda: all(r.state == "dead" for r in rows(engine, "g").values()),
            30,
            "the outage to kill every row",
            describe=lambda: {mid: (r.state, r.attempts) for mid, r in rows(engine, "g").items()},
        )
        assert breaker(engine)["state"] == "OPEN"
        down.clear()  # the dependency is back; the poison row still fails
        recovered = time.monotonic()

        def settled() -> bool:
            row = poison_row()
            return (
                breaker(engine)["state"] == "CLOSED"
                and row.state == "dead"
                and row.refunds >= MAX_REFUNDS
                and all(done[mid] for mid in normal)
            )

        wait_until(
            settled,
            20,
            "the group to close for good with the poison row dead at the refund cap",
            describe=lambda: (breaker(engine), poison_row(), dict(done)),
        )
        settled_after = time.monotonic() - recovered
        closed = breaker(engine)
        # no reopen by the poison row alone: over 10 probe intervals and 15 heartbeats
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            now = breaker(engine)
            assert (now["state"], now["epoch"]) == ("CLOSED", closed["epoch"]), now
            poison_row()
            time.sleep(0.1)
    finally:
        consumer.stop(timeout=10)

    final = rows(engine, "g")
    assert {mid: done[mid] for mid in normal} == dict.fromkeys(normal, 1)  # each exactly once
    assert all(final[mid].state == "done" for mid in normal if mid in final)  # or pruned
    row = final[poison]
    assert (row.state, row.error_class) == ("dead", "systemic")
    # a failed probe of a dead row charges no attempt: never past max_attempts
    assert most_attempts <= MAX_ATTEMPTS, most_attempts
    assert row.refunds == MAX_REFUNDS  # the cap ended it, and it is never passed
    assert settled_after < 20
    state, line = monitor.check(engine, "g")
    assert state == "CRITICAL" and "refund cap reached" in line, line
