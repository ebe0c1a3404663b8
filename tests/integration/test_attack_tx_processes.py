"""Attacks on transactional handlers (decision 0042, issue 22 §1) with real member
processes (`tests/tx_member.py`): kill -9 mid-handler, mid-commit and right after
the commit; SIGSTOP past the lease then SIGCONT; SIGTERM (once, twice) while
handlers' transactions are open. Each attack runs twice: on the single-message
handler and on the batch handler (`batch_handler=`, one transaction for a batch),
and the batch handler's `PartialFailure` is attacked under kill -9.

The effect table has no unique key: a duplicate effect is a second row. After each
attack an in-process member drains the group; then every message's effect row
exists exactly once and the group's done count equals the messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import (
    FAST,
    TESTS_DIR,
    commit_waiting,
    commits_wait,
    finish,
    rows,
    spawn_tx_member,
    transactional_consumer,
    wait_until,
)
from sqlalchemy import Connection, Engine, text

import pgq

WAIT = 30.0
LEASE = 2.0
COMMIT_LOCK = (20_517, 11)
"""The advisory lock a transaction that ends a lease waits for at its COMMIT while
`commits_wait` is in place and the test holds it."""


@pytest.fixture
def effects(orders: Engine, schema: str) -> str:
    table = f'"{schema}".effects'
    with orders.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (message_id bigint, attempt int, member text)"))
    return table


def effect_counts(engine: Engine, table: str) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.execute(text(f"SELECT message_id FROM {table}")))


def done_count(engine: Engine) -> int:
    return int(pgq.status(engine, "billing")["counts"]["done"])


class Members:
    """`tx_member.py` processes of group `billing`, by name."""

    def __init__(
        self, dsn: str, schema: str, table: str, out: Path, procs: list, batch: bool
    ) -> None:
        self.dsn, self.schema, self.table, self.out, self.procs = dsn, schema, table, out, procs
        self.batch = batch
        """Batch handlers (`batch_handler=`) rather than single-message ones."""
        self.by_name: dict[str, subprocess.Popen[str]] = {}

    def spawn(
        self,
        name: str,
        until_empty: bool = False,
        lock_key: int | None = None,
        partial: list[int] = (),  # type: ignore[assignment]
        **settings: object,
    ) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        env.update(
            TXQ_DSN=self.dsn,
            TXQ_SCHEMA=self.schema,
            TXQ_GROUP="billing",
            TXQ_NAME=name,
            TXQ_EFFECTS=self.table,
            TXQ_DIR=str(self.out),
            TXQ_SETTINGS=json.dumps({**FAST, "lease": LEASE, "workers": 2, **settings}),
            TXQ_UNTIL_EMPTY="1" if until_empty else "0",
            TXQ_BATCH="1" if self.batch else "0",
            TXQ_PARTIAL=",".join(map(str, partial)),
        )
        if lock_key is not None:
            env["TXQ_LOCK_KEY"] = str(lock_key)
        proc = spawn_tx_member(env, self.out / f"{name}.log")
        self.procs.append(proc)
        self.by_name[name] = proc

    def notes(self, name: str) -> list[str]:
        path = self.out / f"notes-{name}"
        return path.read_text().splitlines() if path.exists() else []

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text()

    def started(self, name: str, mid: int) -> bool:
        return any(line.startswith(f"started {mid} ") for line in self.notes(name))

    def returned(self, name: str, mid: int) -> bool:
        return any(line.startswith(f"returned {mid} ") for line in self.notes(name))

    def hold(self, mid: int) -> None:
        (self.out / f"hold-{mid}").touch()

    def go(self, mid: int) -> None:
        (self.out / f"go-{mid}").touch()


@pytest.fixture(params=["single", "batch"])
def members(request, pg_dsn, schema, effects, tmp_path, procs) -> Members:
    return Members(pg_dsn, schema, effects, tmp_path, procs, batch=request.param == "batch")


def write_effect(table: str) -> Callable[[pgq.Message, Connection], None]:
    def handler(message: pgq.Message, conn: Connection) -> None:
        conn.execute(
            text(f"INSERT INTO {table} VALUES (:id, :attempt)"),
            {"id": message.id, "attempt": message.attempt},
        )

    return handler


def drain(
    engine: Engine, table: str, expected: int, batch: bool = False, **settings: object
) -> pgq.RunSummary:
    """An in-process member finishes what is left (reclaiming expired leases), with a
    batch handler when `batch`."""
    consumer = transactional_consumer(
        engine,
        write_effect(table),
        batch=batch,
        lease=LEASE,
        **{**FAST, **settings},
    )
    consumer.start()
    try:
        wait_until(
            lambda: done_count(engine) == expected,
            WAIT,
            "the drain",
            describe=lambda: (pgq.status(engine, "billing")["counts"], rows(engine, "billing")),
        )
    finally:
        summary = consumer.stop(timeout=10)
    return summary


def assert_invariant(engine: Engine, table: str, ids: list[int]) -> None:
    assert effect_counts(engine, table) == Counter(ids)
    assert done_count(engine) == len(ids)


@pytest.fixture
def holder(pg_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def test_kill_9_mid_handler(orders, effects, members):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(6)])
    members.hold(ids[2])
    members.spawn("a")
    wait_until(lambda: members.started("a", ids[2]), WAIT, "a's handler on the held message")
    members.by_name["a"].kill()
    members.by_name["a"].wait(10)
    drain(orders, effects, len(ids), members.batch)
    assert_invariant(orders, effects, ids)


def test_kill_9_mid_commit(orders, schema, effects, members, holder):
    """The member dies while its COMMIT waits on the server: the server finishes that
    transaction on its own (effect and ack together)."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])
    commits_wait(orders, schema, COMMIT_LOCK)
    holder.execute("SELECT pg_advisory_lock(%s, %s)", COMMIT_LOCK)
    members.spawn("a", workers=1)
    wait_until(lambda: commit_waiting(holder, COMMIT_LOCK), WAIT, "a's commit to wait")
    members.by_name["a"].kill()
    members.by_name["a"].wait(10)
    holder.execute("SELECT pg_advisory_unlock(%s, %s)", COMMIT_LOCK)
    drain(orders, effects, len(ids), members.batch)
    assert_invariant(orders, effects, ids)


def test_kill_9_right_after_the_commit(orders, schema, effects, members, holder):
    ids = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])
    commits_wait(orders, schema, COMMIT_LOCK)
    holder.execute("SELECT pg_advisory_lock(%s, %s)", COMMIT_LOCK)
    members.spawn("a", workers=1)
    wait_until(lambda: commit_waiting(holder, COMMIT_LOCK), WAIT, "a's commit to wait")
    members.by_name["a"].send_signal(signal.SIGSTOP)  # its answer will wait
    holder.execute("SELECT pg_advisory_unlock(%s, %s)", COMMIT_LOCK)
    wait_until(lambda: effect_counts(orders, effects)[ids[0]] == 1, WAIT, "the commit")
    members.by_name["a"].kill()  # the commit happened; a never read its answer
    members.by_name["a"].wait(10)
    drain(orders, effects, len(ids), members.batch)
    assert_invariant(orders, effects, ids)


def test_sigstop_past_the_lease_then_sigcont_rolls_the_stale_attempt_back(orders, effects, members):
    ids = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}, {"n": 3}])
    members.hold(ids[1])
    members.spawn("a")
    a = members.by_name["a"]
    wait_until(lambda: members.started("a", ids[1]), WAIT, "a's handler on the held message")
    a.send_signal(signal.SIGSTOP)
    drain(orders, effects, len(ids), members.batch)  # after a's lease ran out
    members.go(ids[1])
    a.send_signal(signal.SIGCONT)
    wait_until(lambda: members.returned("a", ids[1]), WAIT, "a's stale handler to return")
    wait_until(lambda: "outcome refused" in members.log("a"), WAIT, "a's outcome refused")
    a.send_signal(signal.SIGTERM)
    code, _, _ = finish(a, 30)
    assert code == 0, members.log("a")
    assert_invariant(orders, effects, ids)


def test_a_stopped_members_transaction_does_not_hold_its_locks_forever(orders, effects, members):
    """The handler takes a lock (a row, an advisory lock) in pgq's transaction; its
    member is stopped (SIGSTOP) past the lease and stays stopped. The stale
    transaction stays open on the server (idle in transaction) with its locks, so
    the message's next attempt elsewhere blocks behind it and times out, again and
    again: the message goes dead (or never finishes) for a member that is gone. pgq
    owns that transaction; it must not outlive the attempt for good (as its own
    connections cannot: `idle_in_transaction_session_timeout`)."""
    ids = pgq.publish_many(orders, "orders", [{"n": 1}])
    members.hold(ids[0])
    members.spawn("a", lock_key=7, handler_timeout=3.0)
    a = members.by_name["a"]
    wait_until(lambda: members.started("a", ids[0]), WAIT, "a's handler holding its lock")
    a.send_signal(signal.SIGSTOP)

    def locking(message: pgq.Message, conn: Connection) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(7, :id)"), {"id": message.id})
        write_effect(effects)(message, conn)

    consumer = pgq.Consumer(
        orders,
        "billing",
        locking,
        transactional=True,
        lease=LEASE,
        handler_timeout=3.0,
        max_attempts=3,
        **FAST,
    )
    consumer.start()
    try:
        wait_until(
            lambda: done_count(orders) == 1 or rows(orders, "billing")[ids[0]].state == "dead",
            60,
            "the message to end while a is stopped",
        )
    finally:
        summary = consumer.stop(timeout=5)
        members.go(ids[0])
        a.send_signal(signal.SIGCONT)
    assert done_count(orders) == 1, (summary, rows(orders, "billing")[ids[0]])
    assert effect_counts(orders, effects) == Counter(ids)


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_with_transactions_open(orders, effects, members, signals):
    """SIGTERM while two handlers hold their transactions open: once (graceful; the
    grace runs out), twice (exit at once). Nothing of theirs commits without its
    ack; the drain finishes the rest."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    for mid in ids[:2]:
        members.hold(mid)
    members.spawn("a", workers=2, shutdown_grace=1.0)
    a = members.by_name["a"]
    wait_until(lambda: all(members.started("a", mid) for mid in ids[:2]), WAIT, "two held handlers")
    a.send_signal(signal.SIGTERM)
    if signals == 2:
        wait_until(lambda: "stopping on signal" in members.log("a"), WAIT, "the first signal")
        a.send_signal(signal.SIGTERM)
    code, _, _ = finish(a, 30)
    assert code in (0, 1), members.log("a")
    for mid in ids[:2]:
        members.go(mid)
    drain(orders, effects, len(ids), members.batch)
    assert_invariant(orders, effects, ids)


def test_sigterm_then_the_handlers_finish_within_the_grace(orders, effects, members):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    for mid in ids[:2]:
        members.hold(mid)
    members.spawn("a", workers=2, shutdown_grace=20.0)
    a = members.by_name["a"]
    wait_until(lambda: all(members.started("a", mid) for mid in ids[:2]), WAIT, "two held handlers")
    a.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping on signal" in members.log("a"), WAIT, "the signal")
    for mid in ids[:2]:
        members.go(mid)
    code, _, _ = finish(a, 30)
    assert code == 0, members.log("a")
    assert all(effect_counts(orders, effects)[mid] == 1 for mid in ids[:2])
    drain(orders, effects, len(ids), members.batch)
    assert_invariant(orders, effects, ids)


@pytest.mark.parametrize("members", ["batch"], indirect=True)
@pytest.mark.parametrize("kill", ["at_the_partial_failure", "in_the_rerun"])
def test_kill_9_around_a_partial_failure(orders, effects, members, kill):
    """The batch handler writes every message's effect, then fails one alone
    (`PartialFailure`): all its writes roll back, the named message's failure goes to
    the acker, the others back to ready. The member is killed as it raises (the
    failure and the release perhaps not written yet), or while it runs the others
    again (held). Whatever was written then, the drain ends with each effect once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    if kill == "in_the_rerun":
        members.hold(ids[1])
    members.spawn("a", workers=1, partial=[ids[0]])
    a = members.by_name["a"]
    wait_until(lambda: f"partial {ids[0]}" in members.notes("a"), WAIT, "the partial failure")
    if kill == "in_the_rerun":
        wait_until(
            lambda: [line for line in members.notes("a") if line.startswith(f"started {ids[1]} ")][
                1:
            ],
            WAIT,
            "the others run again",
        )
    a.kill()
    a.wait(10)
    drain(orders, effects, len(ids), members.batch)
    assert_invariant(orders, effects, ids)
