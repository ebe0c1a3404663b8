"""A member paused past its lease does not start, once resumed, the rows it had
buffered: their leases lapsed and another member took them over (found by the
ordered-group chaos run, `test_ordered.py`: the resumed member ran an old message of a
key while the key's next message ran elsewhere). Each is handed back unstarted
instead: fenced, so a lease taken over is left alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

import pgq

from .history import read_attempts
from .procs import Members

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

LEASE = 1.0


def started_after(out: Path, member: str, moment: float) -> list[int]:
    attempts, _ = read_attempts(out)
    return [a.id for a in attempts if a.member == member and a.event == "start" and a.at > moment]


def test_a_resumed_member_hands_back_the_rows_whose_leases_lapsed(
    engine: Engine, members: Members, out: Path
) -> None:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(12)])
    settings = {"PGQ_LEASE": LEASE, "PGQ_PREFETCH": 8, "CHAOSQ_SLEEP": 0.3}
    slow = members.spawn("slow", "g", workers=1, **settings)
    deadline = time.monotonic() + 20
    while not started_after(out, "slow", 0):
        assert time.monotonic() < deadline and slow.alive(), slow.stderr()
        time.sleep(0.02)
    slow.pause()  # one row running, up to 8 buffered: every lease lapses
    time.sleep(LEASE + 1.5)
    other = members.spawn("other", "g", workers=4, until_empty=True, CHAOSQ_SLEEP=0.01)
    assert other.wait(30) == 0, other.stderr()
    resumed = time.time()
    slow.resume()
    time.sleep(LEASE * 2)  # the buffered rows would have started by now
    slow.term()
    assert slow.wait(20) == 0, slow.stderr()
    assert started_after(out, "slow", resumed) == []
    assert pgq.status(engine, "g")["counts"]["done"] == len(ids)
