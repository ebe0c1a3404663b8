"""Defects found by attacking the running system that no other test guarded.

Each test here replaces a reproduction script that lived in `scripts/attacks/`;
docs/defects.md lists every defect found that way with its fixing commit and the
test that guards it.
"""

from __future__ import annotations

import time

from helpers import FAST, pin_frontier, rows

import pgq
from pgq.consumer.handling import Handling

WAIT = 30.0


class _Unloggable(Exception):
    """Every attribute read that its instance dict cannot answer raises KeyError,
    dunders included: `traceback` reads `__notes__` that way, so logging it fails."""

    def __getattr__(self, name: str) -> object:
        raise KeyError(name)


def test_a_crash_whose_logging_fails_still_stops_the_member(orders, monkeypatch):
    """A worker thread that dies of an exception which cannot even be logged must
    still stop the member. `Member.crash` logged first and stopped second, so the
    logging error escaped before the stop: the member ran on with no worker, the row
    stayed leased (its lease extended) and `--until-empty` never returned. Fixed in
    98176e9 (stop first, then log); the handler path that reached it then fails as
    `message` instead (test_delivery_faults.py), so a worker is crashed here directly."""
    engine = orders
    pin_frontier(engine, "orders")
    mid = pgq.publish(engine, "orders", {"n": 1})

    def run(self: Handling, row: object) -> object:
        raise _Unloggable("a worker crash nobody can format")

    monkeypatch.setattr(Handling, "run", run)
    consumer = pgq.Consumer(engine, "billing", lambda message: None, workers=1, **FAST)
    started = time.monotonic()
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    took = time.monotonic() - started
    assert summary.stop_reason == "signal", summary
    assert not consumer.clean
    assert took < WAIT / 2, f"the member ran {took:.1f}s with a dead worker"
    assert rows(engine, "billing")[mid].state in ("ready", "leased")
