"""The circuit breaker with real consumer processes (DESIGN §6).

Three `pgq consume` members share a simulated dependency (tests/outage_handlers.py):
it is down while a flag file exists. Settings are short so a whole outage
takes seconds; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import rows, wait_until
from members import ConsumeProcesses, consume_processes
from sqlalchemy import Engine

import pgq
from pgq import monitor
from pgq.store import probe_lock_key

pytestmark = pytest.mark.slow

SETTINGS = {
    "PGQ_WORKERS": 2,
    "PGQ_LEASE": 5,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_MAX_ATTEMPTS": 2,
    "PGQ_RETRY_BACKOFF": 0.02,
    "PGQ_RETRY_BACKOFF_MAX": 0.05,
    "PGQ_BREAKER_WINDOW": 10,
    "PGQ_BREAKER_MIN_CALLS": 10,
    "PGQ_BREAKER_OPEN_FOR": 0.5,
    "PGQ_BREAKER_OPEN_FOR_MAX": 1,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": 1.5,
    "PGQ_BREAKER_PROBE_INTERVAL": 0.3,
    "PGQ_BREAKER_PROBE_INTERVAL_MAX": 0.6,
}
GOOD, POISON = 300, 5


class Group(ConsumeProcesses):
    """Three members of group `g` on topic `t`, with their flag directory."""

    def __init__(self, engine: Engine, env: dict[str, str], out: Path) -> None:
        super().__init__(engine, env, out, "outage_handlers:flaky", SETTINGS)

    def start(self, name: str, **extra: object) -> None:
        self.spawn(name, **extra)

    def status(self) -> dict:
        return pgq.status(self.engine, "g")

    def member(self, name: str) -> dict:
        found = [m for m in monitor.members(self.engine, "g", 1.5) if m["name"] == name]
        return found[0] if found else {}

    def done_records(self) -> dict[int, list[int]]:
        """message id -> the `attempt` of every successful handler call."""
        seen: dict[int, list[int]] = {}
        for path in self.out.glob("done-*"):
            for line in path.read_text().splitlines():
                mid, _, attempt = line.split()
                seen.setdefault(int(mid), []).append(int(attempt))
        return seen


@pytest.fixture
def group(engine: Engine, pgq_env: dict[str, str], tmp_path: Path) -> Iterator[Group]:
    with consume_processes(Group, engine, pgq_env, tmp_path) as g:
        yield g


def probe_lock_holders(pg_dsn: str, schema: str) -> int:
    key = probe_lock_key(schema, "g")
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
        ).fetchone()[0]


def publish_work(engine: Engine, good: int = GOOD, poison: int = POISON) -> list[int]:
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(good)])
    return ids + pgq.publish_many(engine, "t", [{"poison": True}] * poison)


def drained(g: Group) -> bool:
    s = g.status()
    return s["lag"] == 0 and s["breaker"]["state"] == "CLOSED"


def test_outage_opens_group_probes_once_and_refunds_on_close(group, pg_dsn, schema):
    # one attempt each: every failure before the trips kills its row, so a member
    # trips only after 20 rows died of the outage (whatever the timing)
    good = 100
    ids = publish_work(group.engine, good=good)
    poison_ids = set(ids[good:])
    (group.out / "down").touch()
    for name in ("m1", "m2", "m3"):
        group.start(name, PGQ_BREAKER_WINDOW=20, PGQ_BREAKER_MIN_CALLS=20, PGQ_MAX_ATTEMPTS=1)

    wait_until(lambda: group.breaker()["state"] == "OPEN", 30, "the group to open")
    # attempts that started before the open finish; then only the probe may be leased
    wait_until(
        lambda: group.status()["counts"]["leased"] <= 1,
        15,
        "in-flight attempts to end",
        describe=lambda: [
            (m, r.lease_owner) for m, r in rows(group.engine, "g").items() if r.state == "leased"
        ],
    )
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert probe_lock_holders(pg_dsn, schema) <= 1
        leased = [
            (mid, r.lease_owner, r.attempts, r.lease_seq, str(r.updated_at))
            for mid, r in rows(group.engine, "g").items()
            if r.state == "leased"
        ]
        assert len(leased) <= 1, (leased, group.breaker())
        time.sleep(0.05)
    wait_until(lambda: group.breaker()["prober"] is not None, 10, "a prober to be elected")
    assert probe_lock_holders(pg_dsn, schema) == 1
    dead_systemic = {
        mid
        for mid, r in rows(group.engine, "g").items()
        if r.state == "dead" and r.error_class == "systemic"
    }
    assert dead_systemic, "the outage should have killed some rows"
    assert group.status()["counts"]["dead_systemic"] == len(dead_systemic)

    (group.out / "down").unlink()
    wait_until(lambda: drained(group), 60, "the group to close and drain")
    history = monitor.breaker_info(group.engine, "g")["history"]
    closes = [h for h in history if h["state"] == "CLOSED"]
    assert closes and sum(h["refunded"] for h in closes) >= len(dead_systemic)
    assert group.status()["totals"]["refunded"] >= len(dead_systemic)

    final = rows(group.engine, "g")
    assert {mid for mid, r in final.items() if r.state == "dead"} == poison_ids
    assert {final[mid].error_class for mid in poison_ids} == {"message"}
    done = group.done_records()
    for mid in dead_systemic:
        assert done.get(mid) == [1], f"row {mid} should end done with attempts = 1: {done.get(mid)}"
    group.stop_all()


def test_lone_bad_node_trips_alone_and_nothing_is_refunded(group):
    ids = publish_work(group.engine, poison=0)
    # the good members are slow enough that the bad one sees plenty of work
    group.start("good1", PGQ_MAX_ATTEMPTS=20, TESTQ_SLEEP=0.03)
    group.start("good2", PGQ_MAX_ATTEMPTS=20, TESTQ_SLEEP=0.03)
    group.start("bad", PGQ_MAX_ATTEMPTS=20, TESTQ_BAD=1)
    wait_until(lambda: group.member("bad").get("local_breaker") == "open", 30, "bad to trip")
    wait_until(lambda: group.status()["lag"] == 0, 60, "the others to finish")
    s = group.status()
    assert s["breaker"]["state"] == "CLOSED" and s["breaker"]["epoch"] == 0
    assert s["totals"]["refunded"] == 0
    assert s["counts"]["done"] == len(ids) and s["counts"]["dead"] == 0
    assert group.member("bad")["local_breaker"] == "open"
    done = group.done_records()
    assert set(done) == set(ids)
    assert not list(group.out.glob("done-bad"))
    group.stop_all()


def test_prober_killed_another_member_takes_over_and_closes(group):
    publish_work(group.engine, poison=0)
    (group.out / "down").touch()
    for name in ("m1", "m2", "m3"):
        group.start(name)
    wait_until(lambda: group.breaker()["state"] == "OPEN", 30, "the group to open")
    prober = wait_until(lambda: group.breaker()["prober"], 10, "a prober")
    group.procs[prober].send_signal(signal.SIGKILL)
    group.procs[prober].communicate()
    others = {"m1", "m2", "m3"} - {prober}
    wait_until(lambda: group.breaker()["prober"] in others, 20, "another member to take over")
    (group.out / "down").unlink()
    wait_until(lambda: drained(group), 60, "the group to close and drain")
    history = monitor.breaker_info(group.engine, "g")["history"]
    assert history[0]["state"] == "CLOSED" or any(h["state"] == "CLOSED" for h in history)
    assert {h["by_member"] for h in history if h["state"] == "CLOSED"} <= others
    group.stop_all()


def test_a_prober_killed_mid_probe_does_not_hold_the_group_open(group):
    """kill -9 of the prober while its probe's handler runs (handler_timeout at its
    default, 300 s): the slot it reserved frees within member_ttl and another member
    probes and closes (before: the slot stayed reserved for handler_timeout + 1 s)."""
    publish_work(group.engine, poison=0)
    (group.out / "down").touch()
    (group.out / "hang-probes").touch()
    for name in ("m1", "m2", "m3"):
        group.start(name)
    wait_until(lambda: group.breaker()["state"] == "OPEN", 30, "the group to open")
    (probing,) = wait_until(lambda: list(group.out.glob("probing-*")), 20, "a probe to start")
    prober = probing.name.removeprefix("probing-")
    group.procs[prober].send_signal(signal.SIGKILL)
    group.procs[prober].communicate()
    (group.out / "hang-probes").unlink()
    (group.out / "down").unlink()
    wait_until(lambda: group.breaker()["state"] == "CLOSED", 30, "the group to close")
    closes = [
        h for h in monitor.breaker_info(group.engine, "g")["history"] if h["state"] == "CLOSED"
    ]
    assert {h["by_member"] for h in closes} <= {"m1", "m2", "m3"} - {prober}
    wait_until(lambda: drained(group), 60, "the group to drain")
    group.stop_all()


def test_member_still_broken_after_close_stays_locally_open(group):
    publish_work(group.engine, poison=0)
    (group.out / "down").touch()
    (group.out / "down-m3").touch()
    for name in ("m1", "m2", "m3"):
        group.start(name, PGQ_MAX_ATTEMPTS=50)
    wait_until(lambda: group.breaker()["state"] == "OPEN", 30, "the group to open")
    (group.out / "down").unlink()  # the dependency is back, but not for m3
    wait_until(lambda: group.breaker()["state"] == "CLOSED", 30, "the group to close")
    wait_until(lambda: group.status()["lag"] == 0, 60, "m1 and m2 to drain")
    assert group.member("m3")["local_breaker"] == "open"
    assert group.member("m1")["local_breaker"] == "closed"
    assert not list(group.out.glob("done-m3"))
    group.stop_all()


def test_misclassified_poison_is_refunded_at_most_max_refunds_times(engine):
    """A message that always raises ConnectionError: each refund needs a successful probe,
    and past `breaker_max_refunds` the row stays dead, so the loop is bounded."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    cursed = pgq.publish(engine, "t", {"cursed": True})
    pgq.publish_many(engine, "t", [{"i": i} for i in range(200)])

    def handler(msg: pgq.Message) -> None:
        if msg.payload.get("cursed"):
            raise ConnectionError("misclassified poison")
        time.sleep(0.01)

    consumer = pgq.Consumer(
        engine,
        "g",
        handler,
        workers=2,
        max_attempts=1,
        breaker_window=1,
        breaker_min_calls=1,
        breaker_failure_rate=1.0,
        breaker_min_members=1,
        breaker_open_for=0.1,
        breaker_open_for_max=0.2,
        breaker_heartbeat=0.1,
        breaker_member_ttl=1.0,
        breaker_probe_interval=0.1,
        breaker_probe_interval_max=0.2,
        breaker_max_refunds=3,
        poll_interval=0.1,
    )
    # a steady trickle of good messages, so every probe has a real message to try
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.05):
            pgq.publish(engine, "t", {"i": -1})

    publisher = threading.Thread(target=trickle, daemon=True)
    consumer.start()
    publisher.start()
    try:
        wait_until(
            lambda: (
                rows(engine, "g")[cursed].refunds == 3
                and rows(engine, "g")[cursed].state == "dead"
                and pgq.status(engine, "g")["breaker"]["state"] == "CLOSED"
            ),
            60,
            "three refunds, then dead for good",
        )
        stop.set()
        publisher.join(5)
        wait_until(lambda: pgq.status(engine, "g")["lag"] == 0, 60, "the rest to drain")
    finally:
        stop.set()
        consumer.stop(timeout=10)
    history = monitor.breaker_info(engine, "g")["history"]
    closes = [h for h in history if h["state"] == "CLOSED"]
    opens = [h for h in history if h["state"] == "OPEN"]
    row = rows(engine, "g")[cursed]
    assert (row.state, row.refunds, row.error_class) == ("dead", 3, "systemic")
    assert sum(h["refunded"] for h in closes) == 3
    # once the cap is reached the cursed row stops reopening the group
    assert len(opens) <= 4 and len(closes) <= 4


def test_prober_killed_mid_reconciliation_next_leader_finishes(engine, pg_dsn, schema):
    """A prober that dies half-way through the refund: the next leader finishes it,
    and no row is refunded twice for one close."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    n = 12_000
    pgq.publish_many(engine, "t", [{"i": i} for i in range(n)])
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"UPDATE \"{schema}\".delivery SET state = 'dead', error_class = 'systemic',"
            " error_epoch = 1, attempts = 2, refundable_attempts = 2, last_error = 'down'"
        )
        conn.exec_driver_sql(f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = 1")
    dying = (
        "import os, signal, pgq\n"
        "from pgq.store import GroupStore, run_once\n"
        f"e = pgq.connect({pg_dsn!r}, schema={schema!r})\n"
        "info = pgq.store.group_info(e, 'g')\n"
        "s = GroupStore(info.id, 'g', 't', 'dying', 30, 3)\n"
        "close = run_once(e, s.close, 1)\n"
        "assert close == 2, close\n"
        "print(run_once(e, s.reconcile_batch, close, 0, 3, 5000), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", dying],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.strip() == "5000"
    assert monitor.breaker_info(engine, "g")["history"][0]["refunded"] == 5000

    consumer = pgq.Consumer(engine, "g", lambda m: None, workers=2, breaker_heartbeat=0.1)
    consumer.start()
    try:
        wait_until(lambda: pgq.status(engine, "g")["lag"] == 0, 60, "refund and drain")
    finally:
        consumer.stop(timeout=10)
    s = pgq.status(engine, "g")
    assert s["totals"]["refunded"] == n
    assert s["counts"]["done"] == n and s["counts"]["dead"] == 0
    assert monitor.breaker_info(engine, "g")["history"][0]["refunded"] == n
    with engine.connect() as conn:
        owed = conn.exec_driver_sql(f'SELECT reconcile_epoch FROM "{schema}".breaker').scalar()
        refunds = (
            conn.exec_driver_sql(f'SELECT DISTINCT refunds FROM "{schema}".delivery')
            .scalars()
            .all()
        )
    assert owed is None
    assert refunds in ([], [1])  # done rows may be pruned already; the rest refunded once
