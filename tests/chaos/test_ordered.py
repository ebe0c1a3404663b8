"""An ordered group through kills, pauses and cuts (issue 22, part 2): three member
processes on an ordered group of 1,000 keys while two publishers commit batches of
mixed keys out of order; one member is killed with `kill -9` and restarted, one
paused past its lease, every connection cut. Then the history checker: nothing lost
or unexplained, and for every key the handlings never overlapped (unless a fault
explains it) and followed frontier order (`chaos.order`).

`CHAOSQ_SECONDS` sets how long the publishing and the faults last (default 12 s).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

import pgq

from . import history, order
from .procs import CHAOS_SETTINGS, Member, Members
from .proxy import Proxy

SECONDS = float(os.environ.get("CHAOSQ_SECONDS") or 12)
LEASE = float(CHAOS_SETTINGS["PGQ_LEASE"])
TTL = float(CHAOS_SETTINGS["PGQ_BREAKER_MEMBER_TTL"])
TOPIC, GROUP = "ordered", "g"
NAMES = ("o1", "o2", "o3")
KEYS = [f"k{i}" for i in range(1000)]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SECONDS * 1.5 + 110)]


def publisher(engine: Engine, stop: threading.Event, ids: list[int], problems: list[str]) -> None:
    """Until `stop`: a transaction of 2-6 publishes of random keys (3 messages each),
    held open a random moment so that transactions commit out of order."""
    rng = random.Random()
    while not stop.is_set():
        try:
            with engine.begin() as conn:
                batch: list[int] = []
                for _ in range(rng.randint(2, 6)):
                    key = rng.choice(KEYS)
                    batch += pgq.publish_many(conn, TOPIC, [{"k": key}] * 3, key=key)
                time.sleep(rng.uniform(0, 0.05))
            ids.extend(batch)
        except Exception as exc:  # the test fails on it, after the members are stopped
            problems.append(f"PROBLEM publisher: {exc!r}")
            return


def test_each_key_in_order_through_kills_pauses_and_cuts(
    engine: Engine, pgq_env: dict[str, str], proxy: Proxy, members: Members, out: Path
) -> None:
    pgq.create_topic(engine, TOPIC)
    pgq.subscribe(engine, GROUP, TOPIC, ordered=True)
    for name in NAMES:
        members.spawn(name, GROUP, verbose=True)
    members.wait_live(engine, GROUP, NAMES, TTL)

    ids: list[int] = []
    notes: list[str] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=publisher, args=(engine, stop, ids, notes)) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    began = time.monotonic()
    try:
        cycle = 0
        while time.monotonic() - began < SECONDS:
            live = {m.name: m for m in members.members if m.alive()}
            victim, sleeper = live.get(NAMES[cycle % 3]), live.get(NAMES[(cycle + 1) % 3])
            time.sleep(1.0)
            restarted: Member | None = None
            if victim is not None:
                victim.kill9()
                restarted = members.spawn(victim.name, GROUP, verbose=True)
            if sleeper is not None:
                sleeper.pause()
                time.sleep(LEASE + 1.5)  # past its lease: its rows are taken over
                sleeper.resume()
            if restarted is not None:
                members.wait_live(engine, GROUP, [restarted.name], TTL, timeout=15)
            notes.append(f"cycle {cycle}: cut {proxy.cut()} connections")
            cycle += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)

    for member in members.live():
        member.term()
    for member in members.live():
        if member.wait(20) != 0:
            notes.append(f"PROBLEM {member.name} on SIGTERM:\n{member.stderr()}")
    drain = members.spawn("drain", GROUP, until_empty=True, verbose=True)
    if drain.wait(60) != 0:
        notes.append(f"PROBLEM drain:\n{drain.stderr()}")

    faults = history.fault_windows(members.events, proxy.faults, lease=LEASE)
    summary = history.check(
        engine, TOPIC, out, published=ids, faults=faults, lease=LEASE, member_ttl=TTL
    )
    kills = {e.pid: e.at for e in members.events if e.kind == "kill9"}
    violations = order.check(engine, out, TOPIC, GROUP, faults=faults, kill_times=kills)
    counts = f"{len(ids)} messages, {len(violations)} order violations"
    report = "\n".join([str(summary), counts, *violations[:20], *notes])
    history.publish(report)
    assert ids, report
    assert summary.lost == [] and summary.ok, report
    assert violations == [], report
    assert not [n for n in notes if n.startswith("PROBLEM")], report
