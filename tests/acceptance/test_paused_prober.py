"""A prober that stops answering loses the election within `breaker.member_ttl`
(DESIGN §6.4), and one that is merely slow does not.

Real `pgq consume` members share the simulated dependency of
tests/outage_handlers.py (down while the flag file `down` exists). The prober's
lock session ends once it has idled for `member_ttl` (`idle_session_timeout`), so
a SIGSTOPped prober, whose connection lingers, no longer holds the group OPEN;
a live prober keeps that session busy, also while its probe runs longer than
`member_ttl`. The member's liveness lock has no such limit (its heartbeat
decides liveness). Every wait is bounded.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import wait_until
from members import ConsumeProcesses, consume_processes
from sqlalchemy import Engine

import pgq
from pgq import monitor
from pgq.store import (
    GroupStore,
    LostLock,
    group_info,
    member_lock,
    probe_lock,
    probe_lock_key,
    run_once,
)

pytestmark = pytest.mark.slow

MEMBER_TTL = 1.5
SETTINGS = {
    "PGQ_WORKERS": 2,
    "PGQ_LEASE": 5,
    "PGQ_HANDLER_TIMEOUT": 10,
    "PGQ_SHUTDOWN_GRACE": 10,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_MAX_ATTEMPTS": 50,
    "PGQ_RETRY_BACKOFF": 0.02,
    "PGQ_RETRY_BACKOFF_MAX": 0.05,
    "PGQ_BREAKER_WINDOW": 4,
    "PGQ_BREAKER_MIN_CALLS": 4,
    "PGQ_BREAKER_MIN_MEMBERS": 1,
    "PGQ_BREAKER_OPEN_FOR": 0.5,
    "PGQ_BREAKER_OPEN_FOR_MAX": 1,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": MEMBER_TTL,
    "PGQ_BREAKER_PROBE_INTERVAL": 0.3,
    "PGQ_BREAKER_PROBE_INTERVAL_MAX": 0.6,
    "PGQ_BREAKER_PROBER_TURNS": 1000,  # the prober keeps the lock across failed probes
}
TAKEOVER = MEMBER_TTL + 10.0
"""How long the group may stay OPEN once its prober is paused and the dependency is
back: `member_ttl` for the paused lock session to end, then an election and a
probe (a few probe intervals), with slack for a busy two-core machine."""


class Members(ConsumeProcesses):
    """`pgq consume g` processes by name, with their logs and flag directory."""

    def __init__(self, engine: Engine, env: dict[str, str], out: Path) -> None:
        super().__init__(engine, env, out, "outage_handlers:flaky", SETTINGS)

    def start(self, name: str, **extra: object) -> None:
        self.spawn(name, **extra)

    def closes(self) -> list[dict]:
        history = monitor.breaker_info(self.engine, "g")["history"]
        return [h for h in history if h["state"] == "CLOSED"]

    def stop_all(self) -> None:
        """Every member exits 0 on SIGTERM, with no traceback in its log."""
        super().stop_all(killed_ok=False, clean_logs=True)


@pytest.fixture
def members(engine: Engine, pgq_env: dict[str, str], tmp_path: Path) -> Iterator[Members]:
    with consume_processes(Members, engine, pgq_env, tmp_path) as group:
        yield group


def probe_lock_pids(pg_dsn: str, schema: str) -> list[int]:
    """The backends holding the group's probe lock."""
    key = probe_lock_key(schema, "g")
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
        ).fetchall()
    return [pid for (pid,) in found]


def open_group(members: Members, names: tuple[str, ...], **extra: object) -> tuple[str, int]:
    """Start `names` with the dependency down; wait for the group to open and elect a
    prober; returns the prober's name and the epoch of the outage."""
    (members.out / "down").touch()
    for name in names:
        members.start(name, **extra)
    wait_until(lambda: members.breaker()["state"] == "OPEN", 30, "the group to open")
    prober = wait_until(lambda: members.breaker()["prober"], 15, "a prober to be elected")
    return prober, members.breaker()["epoch"]


def test_paused_prober_loses_the_election_and_steps_down_when_resumed(members, pg_dsn, schema):
    good = pgq.publish_many(members.engine, "t", [{"i": i} for i in range(60)])
    prober, epoch = open_group(members, ("m1", "m2", "m3"))
    paused = members.procs[prober]
    paused.send_signal(signal.SIGSTOP)
    (paused_pid,) = probe_lock_pids(pg_dsn, schema)
    assert members.breaker()["prober"] == prober  # the paused one holds the lock
    (members.out / "down").unlink()

    # another member is elected and closes the outage while the prober is paused
    wait_until(
        lambda: members.breaker()["state"] == "CLOSED",
        TAKEOVER,
        f"the group to close while its prober {prober} is paused",
        describe=lambda: (members.breaker(), probe_lock_pids(pg_dsn, schema)),
    )
    (close,) = [h for h in members.closes() if h["epoch"] > epoch]
    assert close["by_member"] != prober
    assert paused_pid not in probe_lock_pids(pg_dsn, schema)
    wait_until(
        lambda: pgq.status(members.engine, "g")["counts"]["done"] == len(good),
        60,
        "every row to be done",
        describe=lambda: pgq.status(members.engine, "g")["counts"],
    )
    assert pgq.status(members.engine, "g")["counts"]["dead"] == 0

    # resumed, the old prober finds its lock gone: it steps down and closes nothing
    paused.send_signal(signal.SIGCONT)
    wait_until(
        lambda: any(
            m["name"] == prober and m["live"] for m in pgq.status(members.engine, "g")["members"]
        ),
        10,
        "the resumed member to heartbeat again",
    )
    # a few probe turns later it still runs, as a plain member
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert paused.poll() is None, members.log_text(prober)
        assert probe_lock_pids(pg_dsn, schema) == []
        time.sleep(0.1)
    log = members.log_text(prober)
    assert log.count("prober stepped down") <= 1, log
    assert "by=probe" not in log, log
    closes = [(h["epoch"], h["by_member"]) for h in members.closes() if h["epoch"] > epoch]
    assert closes == [(close["epoch"], close["by_member"])]
    after = members.breaker()
    assert (after["state"], after["prober"], after["epoch"]) == ("CLOSED", None, close["epoch"])
    members.stop_all()


def test_slow_probe_and_long_probe_interval_keep_the_lock(members, pg_dsn, schema):
    """A prober that waits longer than `member_ttl` between probes, and whose probe
    then runs for several `member_ttl`s, stays alive: it keeps the lock throughout and
    closes the group itself, with one probe."""
    slow, interval = 3 * MEMBER_TTL, 2 * MEMBER_TTL
    pgq.publish_many(members.engine, "t", [{"i": i} for i in range(3)])
    # successful calls sleep `slow` seconds; while the dependency is down they fail at once
    prober, epoch = open_group(
        members,
        ("m1", "m2"),
        TESTQ_SLEEP=slow,
        PGQ_BREAKER_PROBE_INTERVAL=interval,
        PGQ_BREAKER_PROBE_INTERVAL_MAX=interval,
    )
    (holder,) = probe_lock_pids(pg_dsn, schema)
    seen: set[int] = set()
    deadline = time.monotonic() + interval + MEMBER_TTL  # failed probes, waits between
    while time.monotonic() < deadline:
        seen.update(probe_lock_pids(pg_dsn, schema))
        time.sleep(0.1)
    back = time.monotonic()
    (members.out / "down").unlink()

    def closed() -> bool:
        seen.update(probe_lock_pids(pg_dsn, schema))
        return members.breaker()["state"] == "CLOSED"

    wait_until(closed, 30, "the slow probe to close the group")
    assert time.monotonic() - back >= slow  # the probe outlived member_ttl
    assert seen == {holder}
    (close,) = [h for h in members.closes() if h["epoch"] > epoch]
    assert close["by_member"] == prober
    for name in members.procs:
        assert "prober stepped down" not in members.log_text(name)
    members.stop_all()


def test_only_the_probe_lock_session_ends_when_idle(engine, pg_dsn, schema):
    """The probe lock's session ends once idle for its limit, not while kept busy;
    the member's liveness lock, idle as long, stays."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    info = group_info(engine, "g")
    run_once(engine, GroupStore(info.id, "g", "t", "idle", 30, 3).join, 30.0, True)
    probe = probe_lock(engine, "g", idle_timeout=0.5)
    member = member_lock(engine, info.id, "idle")
    try:
        assert probe.acquire()
        assert member.acquire()
        deadline = time.monotonic() + 1.5  # three times the limit, kept busy
        while time.monotonic() < deadline:
            probe.check()
            time.sleep(probe.keep_every)
        wait_until(lambda: not probe_lock_pids(pg_dsn, schema), 5, "the idle session to end")
        with pytest.raises(LostLock):
            probe.check()
        member.check()
    finally:
        probe.release()
        member.release()
