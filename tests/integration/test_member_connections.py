"""A member's connections (DESIGN §7, "Connections"; decision 0027): at most three,
each named `pgq/<group>/<member>/<role>` in `pg_stat_activity`, busy or idle,
delivering or probing through an outage.

Before: one member with 8 workers held 8 unnamed connections, so 14 idle members
filled a default server's `max_connections = 100`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from helpers import FAST, LONE_OUTAGE, wait_until
from sqlalchemy import Engine

import pgq
from pgq.store import conninfo_of

ROLES = {"session", "claims", "work"}


class Sampler:
    """Reads `pg_stat_activity` every few milliseconds on a connection of its own:
    the most backends of the test database seen at once beyond those open before
    it started, and the names of a member's backends."""

    def __init__(self, engine: Engine, prefix: str) -> None:
        self.conninfo = conninfo_of(engine)
        self.prefix = prefix
        self.stop = threading.Event()
        self.most = 0
        self.most_named = 0
        self.names: set[str] = set()
        self.samples = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _count(self, conn: psycopg.Connection) -> tuple[int, list[str]]:
        rows = conn.execute(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
        ).fetchall()
        return len(rows), [r[0] for r in rows if r[0].startswith(self.prefix)]

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            total, named = self._count(self._conn)
            self.most = max(self.most, total - self.before)
            self.most_named = max(self.most_named, len(named))
            self.names.update(named)
            self.samples += 1

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        self._conn = psycopg.connect(self.conninfo, autocommit=True)
        try:
            self.before, _ = self._count(self._conn)
            self._thread.start()
            yield self
        finally:
            self.stop.set()
            self._thread.join(10)
            self._conn.close()


def test_a_busy_member_of_eight_workers_holds_three_named_connections(orders: Engine):
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(3000)])
    engine.dispose()  # the publisher's pooled connections are not the member's
    consumer = pgq.Consumer(engine, "billing", lambda m: None, name="m1", workers=8, **FAST)
    with Sampler(engine, "pgq/billing/m1/").running() as seen:
        summary = consumer.run(until_empty=True)
        wait_until(lambda: seen.samples > 0, 10, "a sample")
    assert summary.done == 3000
    assert seen.names == {f"pgq/billing/m1/{role}" for role in ROLES}
    assert seen.most_named <= 3
    assert seen.most <= 3, f"{seen.most} backends of the database at once beyond the baseline"


def test_a_prober_through_an_outage_holds_no_more_connections(orders: Engine):
    """The probe lock and the prober's statements ride on the member's own
    connections (before: a lock connection and a prober connection of their own)."""
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(40)])
    engine.dispose()
    healthy = threading.Event()
    probes: list[int] = []

    def handler(msg: pgq.Message) -> None:
        if not healthy.is_set():
            raise ConnectionError("the dependency is down")
        probes.append(msg.id)

    consumer = pgq.Consumer(engine, "billing", handler, name="m1", **LONE_OUTAGE)
    with Sampler(engine, "pgq/billing/m1/").running() as seen:
        consumer.start()
        try:
            wait_until(
                lambda: pgq.status(engine, "billing")["breaker"]["prober"] == "m1",
                20,
                "the member to probe an open group",
            )
            healthy.set()
            wait_until(
                lambda: pgq.status(engine, "billing")["breaker"]["state"] == "CLOSED",
                20,
                "the group to close",
            )
        finally:
            consumer.stop(timeout=10)
    assert probes
    assert seen.names <= {f"pgq/billing/m1/{role}" for role in ROLES}
    assert seen.most_named <= 3
    # the status reads above run on the test's engine: count the member's alone
    assert seen.most_named == 3


def test_the_probe_lock_and_the_liveness_lock_share_the_session_connection(orders: Engine):
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(20)])
    consumer = pgq.Consumer(
        engine, "billing", _always_down, name="m1", **{**LONE_OUTAGE, "max_attempts": 100}
    )
    consumer.start()
    try:
        wait_until(
            lambda: pgq.status(engine, "billing")["breaker"]["prober"] == "m1",
            20,
            "the member to probe an open group",
        )
        with psycopg.connect(conninfo_of(engine), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT a.application_name, count(*) FROM pg_locks l"
                " JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted"
                " AND a.application_name LIKE 'pgq/billing/m1/%%'"
                " GROUP BY 1"
            ).fetchall()
        # liveness, probe lock and the prober's name, on one session
        assert rows == [("pgq/billing/m1/session", 3)]
    finally:
        consumer.stop(timeout=10)


def _always_down(msg: pgq.Message) -> None:
    raise ConnectionError("the dependency is down")


def test_a_cancel_aimed_at_one_role_never_reaches_the_next_roles_statement(engine: Engine):
    """Stopping a member cancels its VACUUM on the claims connection (decision 0027);
    found in a cron run of the suite: the request landed on the final pass's
    statement that followed the VACUUM on that connection, and the run failed with
    "canceling statement due to user request". A cancel now holds the role's turn
    until the request is in, and the session it went to ends with that turn: the
    server acts on a request at its next interrupt check, which may come only in
    the next statement (a loaded run of the suite saw 1 of 150 land there)."""
    from sqlalchemy import text

    from pgq.errors import PgqError
    from pgq.store import Link, RoleConnection

    link = Link(engine, "claims")
    stop = threading.Event()
    vacuum = RoleConnection(link, "vacuum", stop)
    final = RoleConnection(link, "final", stop)
    cancelled = {"vacuum": 0, "final": 0}

    def cancel_vacuum() -> None:
        while not stop.is_set():
            vacuum.cancel()

    canceller = threading.Thread(target=cancel_vacuum, daemon=True)
    canceller.start()
    try:
        for _ in range(150):
            for role in (vacuum, final):
                try:
                    role.run(lambda conn: conn.execute(text("SELECT pg_sleep(0.002)")))
                except PgqError:
                    cancelled[role.role] += 1
    finally:
        stop.set()
        canceller.join(10)
        link.close()
    assert cancelled["vacuum"] > 0, "the cancels never reached the vacuum: the test saw nothing"
    assert cancelled["final"] == 0, cancelled
