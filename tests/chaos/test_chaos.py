"""End to end: three real members, concurrent publishers, subscribers and retention,
a `kill -9`, a SIGSTOP past the lease, and a cut of every connection; then a
drain and the history checker: nothing lost, every duplicate explained.

A second group of the topic, `txwork`, has three transactional members
(`tests/tx_member.py`: two with a batch handler, one with a single-message one)
that write one effect row per message in the transaction that acks it; the
checker wants exactly one effect per message there (no duplicate is excused).

Each 12 s cycle kills one member of each group (and restarts it under its name
at once), pauses another of each past its lease, and cuts every connection
through the proxy.
`CHAOSQ_SECONDS` sets how long the chaos lasts (default 12 s, one cycle; the
whole test stays under a minute). Longer runs repeat the cycle, rotating the
victims, e.g.
`CHAOSQ_SECONDS=600 pytest tests/chaos/test_chaos.py -s` for ten minutes.
The checker's summary is printed in pytest's terminal summary ("chaos history"),
and appended to the file `$CHAOSQ_REPORT` when that is set.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

import pgq

from . import history
from .drivers import Drivers
from .procs import CHAOS_SETTINGS, InProcessMembers, Member, Members
from .proxy import Proxy

SECONDS = float(os.environ.get("CHAOSQ_SECONDS") or 12)
"""How long the chaos lasts."""

CYCLE = min(12.0, SECONDS)
"""One fault cycle: a kill, a pause past the lease, a cut."""

LEASE = float(CHAOS_SETTINGS["PGQ_LEASE"])
TTL = float(CHAOS_SETTINGS["PGQ_BREAKER_MEMBER_TTL"])
TOPIC, GROUP, TXGROUP = "chaos", "work", "txwork"
NAMES = ("m1", "m2", "m3")
TXNAMES = {"t1": True, "t2": False, "t3": True}
"""The transactional members of `TXGROUP`, and whether each handles batches (cycle 0
kills a batch member and pauses the single-message one)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SECONDS * 1.25 + 110)]


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def chaos(engine: Engine, members: Members, proxy: Proxy, notes: list[str]) -> None:
    """Kill, pause past the lease, cut: once per cycle until SECONDS have passed.

    Cycle n kills `NAMES[n % 3]` and the n-th of `TXNAMES` with `kill -9` and
    restarts each under its name right away (it must be taken over at once, not
    refused), pauses the next member of each group past its lease, and cuts
    every connection.
    """
    groups = {GROUP: NAMES, TXGROUP: tuple(TXNAMES)}
    start = time.monotonic()
    cycle = 0
    while cycle == 0 or (cycle + 1) * CYCLE <= SECONDS:
        t0 = start + cycle * CYCLE
        by_name = {m.name: m for m in members.members if m.alive()}
        victims = [by_name.get(names[cycle % 3]) for names in groups.values()]
        sleepers = [by_name.get(names[(cycle + 1) % 3]) for names in groups.values()]
        sleep_until(t0 + 0.2 * CYCLE)
        restarted = []
        for victim in victims:
            if victim is not None:
                victim.kill9()
                restarted.append(members.again(victim))
        sleep_until(t0 + 0.3 * CYCLE)
        paused = [s for s in sleepers if s is not None and s.alive()]
        for sleeper in paused:
            sleeper.pause()
        time.sleep(LEASE + 1.5)  # past its lease, and past member_ttl
        for sleeper in paused:
            sleeper.resume()
        for member in restarted:
            try:  # a name whose holder was killed is taken over at once
                members.wait_live(engine, member.group, [member.name], TTL, timeout=10)
            except AssertionError as exc:
                notes.append(f"PROBLEM cycle {cycle}: restarting {member.name}: {exc}")
        sleep_until(t0 + 0.75 * CYCLE)
        notes.append(f"cycle {cycle}: cut {proxy.cut()} connections")
        for group, names in groups.items():
            alive = [m.name for m in members.members if m.alive() and m.name in names]
            try:  # the members reconnect and count as live again (their session lock too)
                members.wait_live(engine, group, alive, TTL, timeout=10)
            except AssertionError as exc:
                notes.append(f"PROBLEM cycle {cycle}: after the cut: {exc}")
        cycle += 1


def test_nothing_is_lost_through_kills_pauses_and_cuts(
    engine: Engine,
    pgq_env: dict[str, str],
    proxy: Proxy,
    members: Members,
    in_process: InProcessMembers,
    out: Path,
    schema: str,
) -> None:
    began = time.monotonic()
    pgq.create_topic(engine, TOPIC)
    pgq.subscribe(engine, GROUP, TOPIC)
    pgq.subscribe(engine, TXGROUP, TOPIC)
    effects = history.create_effects(engine, schema, TXGROUP)
    for name in NAMES:
        members.spawn(name, GROUP, verbose=True)
    for name, batch in TXNAMES.items():
        members.spawn_tx(name, TXGROUP, effects, batch=batch)
    members.wait_live(engine, GROUP, NAMES, TTL)
    members.wait_live(engine, TXGROUP, TXNAMES, TTL)

    notes: list[str] = []
    with Drivers(engine, TOPIC, seconds=SECONDS) as drivers:
        drivers.publish(threads=3, tx_threads=1, interval=0.05)
        late_groups = 2 if SECONDS <= 60 else 3
        drivers.subscribe(
            count=late_groups, interval=SECONDS / (late_groups + 1), on_subscribe=in_process.start
        )
        drivers.retain(interval=0.5)
        chaos(engine, members, proxy, notes)
        record = drivers.wait(timeout=SECONDS + 30)
    notes.append(f"drivers: {record.describe()}")
    chaos_done = time.monotonic()

    # stop the members gracefully (all at once), then drain every group with `--until-empty`
    running = members.live()
    for member in running:
        member.term()
    notes += [f"PROBLEM {p}" for p in in_process.stop()]
    for member in running:
        code = member.wait(20)
        if member.tx is not None:  # its stale attempts rolled back: `refused`
            notes.append(f"{member.name}: exit {code} {member.summary()}")
        if code != 0:
            notes.append(f"PROBLEM {member.name} exited {code} on SIGTERM:\n{member.stderr()}")
    stopped = time.monotonic()
    groups = [GROUP, *(s.group for s in record.subscriptions)]
    drains: list[Member] = [
        members.spawn(f"drain-{g}", g, until_empty=True, verbose=True) for g in groups
    ]
    drains.append(
        members.spawn_tx(f"drain-{TXGROUP}", TXGROUP, effects, batch=True, until_empty=True)
    )
    for drain in drains:
        code = drain.wait(45 + SECONDS / 4)
        notes.append(f"{drain.name}: exit {code} {drain.summary()}")
        if code != 0:
            notes.append(f"PROBLEM {drain.name} exited {code}:\n{drain.stderr()}")

    drained = time.monotonic()
    summary = history.check(
        engine,
        TOPIC,
        out,
        record=record,
        faults=history.fault_windows(members.events, proxy.faults, lease=LEASE),
        lease=LEASE,
        member_ttl=TTL,
        cli_env={**pgq_env, **CHAOS_SETTINGS},
        effects={TXGROUP: effects},
    )
    took = (
        f"took {time.monotonic() - began:.1f}s: chaos until {chaos_done - began:.1f}s,"
        f" stopped at {stopped - began:.1f}s, drained at {drained - began:.1f}s,"
        f" checked at {time.monotonic() - began:.1f}s"
    )
    report = "\n".join([str(summary), *notes, took])
    history.publish(report)
    assert summary.lost == [], report
    assert summary.ok, report
    assert not [n for n in notes if n.startswith("PROBLEM")], report
    assert summary.dead == [], report  # the handler never fails: nothing may die
    assert summary.effects[TXGROUP].effects == summary.effects[TXGROUP].messages > 0, report
