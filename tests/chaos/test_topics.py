"""Two topics with three groups each, concurrent publishers (some committing out of id
order), retention, a `kill -9` and a cut of every connection per cycle, a watch on
every group's frontier; then a drain and the history checker: nothing lost, every
duplicate explained, no frontier ever passed an unresolved message.

The run of issue 14's acceptance on Citus, and as well on one server. It runs when
`CHAOSQ_TOPICS_SECONDS` says how long (seconds), or in distributed mode
(`PGQ_TEST_DISTRIBUTED=1`, 35 s by default); otherwise it skips, so the ordinary
single-server run is unchanged. `tests/citus/test_suites.py` runs it on the
cluster for 35 s; `scripts/citus_history.py --seconds 300` for five minutes.

Per topic: group `<topic>a` has two `pgq consume` processes (one of them is
killed with `kill -9` every other cycle and restarted under its name at once),
groups `<topic>b` and `<topic>c` an in-process consumer each; all through the
chaos proxy. Two publisher threads per topic (one of them publishing in two
transactions that commit out of id order) and a retention pass every second.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from fixtures.database import DISTRIBUTED
from psycopg.conninfo import make_conninfo
from sqlalchemy import Engine

import pgq

from . import growth, history
from .drivers import Drivers, Record
from .frontier import FrontierWatch
from .procs import CHAOS_SETTINGS, InProcessMembers, Member, Members
from .proxy import Proxy

SECONDS = float(os.environ.get("CHAOSQ_TOPICS_SECONDS") or (35 if DISTRIBUTED else 0))
"""How long the chaos lasts (0: skip)."""

GROWTH = os.environ.get("CHAOSQ_GROWTH", "")
"""On Citus, what the cluster does a third into the run (`tests/citus/test_growth.py`):
`move` moves the shard of group `taa` to the other worker (after making the node it
leaves run ahead of it in xids), `add:<host>:<port>` adds that node and rebalances."""

CYCLE = 10.0
LEASE = float(CHAOS_SETTINGS["PGQ_LEASE"])
TTL = float(CHAOS_SETTINGS["PGQ_BREAKER_MEMBER_TTL"])
TOPICS = ("ta", "tb")
STATEMENT_TIMEOUT = 10.0
"""Seconds a driver's statement may take (a publisher's lock wait)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(SECONDS * 1.3 + (300 if GROWTH else 150)),
    pytest.mark.skipif(
        SECONDS <= 0,
        reason="CHAOSQ_TOPICS_SECONDS is not set (nor PGQ_TEST_DISTRIBUTED=1): the two-topic"
        " history run is for the cluster and for long runs",
    ),
]


def groups_of(topic: str) -> list[str]:
    return [f"{topic}{g}" for g in "abc"]


def grow(
    engine: Engine, dsn: str, how: str, notes: list[str], blocked: list[tuple[float, float]]
) -> None:
    """Change the cluster under the run as `GROWTH` says; what it did goes to `notes`,
    when (wall time, with a statement timeout after it) to `blocked`."""
    time.sleep(SECONDS / 3)
    began = time.monotonic()
    start = time.time()
    try:
        if how == "move":
            did = growth.move_group_shard(engine, dsn, "taa")
        else:
            _, host, port = how.split(":")
            did = growth.add_node_and_rebalance(engine, host, int(port))
        notes.append(f"growth: {did} in {time.monotonic() - began:.1f}s")
    except Exception as exc:
        notes.append(f"PROBLEM growth {how}: {type(exc).__name__}: {exc}")
    finally:
        blocked.append((start, time.time() + STATEMENT_TIMEOUT))


def faults(engine: Engine, members: Members, proxy: Proxy, notes: list[str]) -> None:
    """One cycle every CYCLE seconds until SECONDS: a `kill -9` of one `a` member
    (alternating topics and names; restarted at once) on even cycles, and a cut of
    every connection through the proxy on every cycle."""
    start = time.monotonic()
    cycle = 0
    while (cycle + 1) * CYCLE <= SECONDS or cycle == 0:
        t0 = start + cycle * CYCLE
        time.sleep(max(0.0, t0 + 0.3 * CYCLE - time.monotonic()))
        if cycle % 2 == 0:
            topic = TOPICS[(cycle // 2) % 2]
            name = f"{topic}a-{1 + (cycle // 4) % 2}"
            victim = next((m for m in reversed(members.members) if m.name == name), None)
            if victim is not None and victim.alive():
                victim.kill9()
                members.spawn(name, f"{topic}a", verbose=True)
                try:
                    # (a member joins by writing its group's shard: a move blocks that)
                    members.wait_live(
                        engine, f"{topic}a", [name], TTL, timeout=60 if GROWTH else 15
                    )
                except AssertionError as exc:
                    notes.append(f"PROBLEM cycle {cycle}: restarting {name}: {exc}")
        time.sleep(max(0.0, t0 + 0.7 * CYCLE - time.monotonic()))
        notes.append(f"cycle {cycle}: cut {proxy.cut()} connections")
        cycle += 1
    time.sleep(max(0.0, start + SECONDS - time.monotonic()))


def test_two_topics_three_groups_nothing_lost_and_the_frontier_never_passes(
    pg_dsn: str,
    schema: str,
    engine: Engine,
    pgq_env: dict[str, str],
    proxy: Proxy,
    members: Members,
    in_process: InProcessMembers,
    out: Path,
) -> None:
    began = time.monotonic()
    groups = [g for topic in TOPICS for g in groups_of(topic)]
    for topic in TOPICS:
        pgq.create_topic(engine, topic)
        for group in groups_of(topic):
            pgq.subscribe(engine, group, topic)
    for topic in TOPICS:
        for n in (1, 2):
            members.spawn(f"{topic}a-{n}", f"{topic}a", verbose=True)
        for group in groups_of(topic)[1:]:
            in_process.start(group)
    for topic in TOPICS:
        members.wait_live(engine, f"{topic}a", [f"{topic}a-1", f"{topic}a-2"], TTL, timeout=30)

    notes: list[str] = []
    blocked: list[tuple[float, float]] = []  # when the cluster moved shards (GROWTH)
    records: dict[str, Record] = {}
    # a publish that waits on a lock forever (on Citus today: behind the same thread's
    # other open transaction, 0023 §3.4) fails after a while, so the run stays bounded
    bounded = pgq.connect(
        make_conninfo(pg_dsn, options=f"-c statement_timeout={STATEMENT_TIMEOUT * 1000:.0f}"),
        schema=schema,
    )
    with FrontierWatch(engine, groups) as watch:
        drivers = [Drivers(bounded, topic, seconds=SECONDS) for topic in TOPICS]
        try:
            for d in drivers:
                d.publish(threads=2, tx_threads=1, interval=0.05)
                d.retain(interval=1.0)
            growing = threading.Thread(
                target=grow, args=(engine, pg_dsn, GROWTH, notes, blocked), name="grow"
            )
            if GROWTH:
                growing.start()
            faults(engine, members, proxy, notes)
            if GROWTH:
                growing.join(SECONDS * 3)
            for topic, d in zip(TOPICS, drivers, strict=True):
                try:
                    records[topic] = d.wait(timeout=30)
                except AssertionError as exc:
                    notes.append(f"PROBLEM drivers of {topic}: {exc}")
                    records[topic] = d.record
                notes.append(f"drivers of {topic}: {records[topic].describe()}")
        finally:
            for d in drivers:
                d.stop()
            bounded.dispose()
        chaos_done = time.monotonic()
        notes.append(f"frontier watch: started again in a new xid space {watch.rebased}")

        # stop everyone gracefully, then drain every group with `--until-empty`
        running = members.live()
        for member in running:
            member.term()
        notes += [f"PROBLEM {p}" for p in in_process.stop()]
        for member in running:
            code = member.wait(20)
            if code != 0:
                notes.append(f"PROBLEM {member.name} exited {code} on SIGTERM:\n{member.stderr()}")
        drains: list[Member] = [
            members.spawn(f"drain-{g}", g, until_empty=True, verbose=True, workers=2)
            for g in groups
        ]
        for drain in drains:
            code = drain.wait(60 + SECONDS / 4)
            notes.append(f"{drain.name}: exit {code} {drain.summary()}")
            if code != 0:
                notes.append(f"PROBLEM {drain.name} exited {code}:\n{drain.stderr()}")
    drained = time.monotonic()

    windows = history.fault_windows(members.events, proxy.faults, lease=LEASE)
    summaries = [
        history.check(
            engine,
            topic,
            out,
            record=records[topic],
            faults=windows,
            lease=LEASE,
            member_ttl=TTL,
            cli_env={**pgq_env, **CHAOS_SETTINGS},
            frontier=watch if topic == TOPICS[0] else None,
            blocked=blocked,
        )
        for topic in TOPICS
    ]
    took = (
        f"took {time.monotonic() - began:.1f}s: chaos until {chaos_done - began:.1f}s,"
        f" drained at {drained - began:.1f}s, checked at {time.monotonic() - began:.1f}s"
    )
    report = "\n".join([*(str(s) for s in summaries), *notes, took])
    history.publish(report)
    assert [s.lost for s in summaries] == [[], []], report
    assert [s.unexplained for s in summaries] == [[], []], report
    assert watch.violations == [] and watch.moved_back == [], report
    assert all(s.ok for s in summaries), report
    assert not [n for n in notes if n.startswith("PROBLEM")], report
