"""Members through PgBouncer in transaction mode (DESIGN §7, "Connections").

The DSN names the pooler (Debian's PgBouncer 1.18: no prepared statements in
transaction mode); `session_dsn` (`--session-dsn`, `PGQ_SESSION_DSN`) names the
server itself, for the one session connection of each member (liveness lock,
LISTEN, probe lock, heartbeat). Claims, outcomes, retries, dead writes and
housekeeping go through the pooler. The `pgbouncer` fixture
(tests/fixtures/pgbouncer.py) starts the pooler in front of this run's database,
over TCP or the embedded server's Unix socket alike.
"""

from __future__ import annotations

import subprocess
import threading
from collections import Counter

import psycopg
import pytest
from fixtures.pgbouncer import Bouncer
from helpers import FAST, PGQ, consumer_env, read_ids, rows, wait_until

import pgq

pytestmark = pytest.mark.timeout(60)

GROUP = "billing"


def transactions(bouncer: Bouncer) -> int:
    """How many transactions PgBouncer has carried to the test database so far."""
    dbname = psycopg.conninfo.conninfo_to_dict(bouncer.dsn)["dbname"]
    return sum(
        int(str(r["total_xact_count"])) for r in bouncer.show("STATS") if r["database"] == dbname
    )


def test_a_member_through_pgbouncer_handles_every_message_once(pgbouncer, schema):
    engine = pgq.connect(pgbouncer.dsn, session_dsn=pgbouncer.direct_dsn, schema=schema)
    try:
        pgq.migrate(engine)  # through the pooler too
        pgq.create_topic(engine, "orders")
        pgq.subscribe(engine, GROUP, "orders")
        good = pgq.publish_many(engine, "orders", [{"n": n} for n in range(300)])
        bad = pgq.publish_many(engine, "orders", [{"fail": n} for n in range(5)])

        lock = threading.Lock()
        handled: Counter[int] = Counter()

        def handle(msg: pgq.Message) -> None:
            with lock:
                handled[msg.id] += 1
            if "fail" in msg.payload:
                raise ValueError(f"message {msg.id} is bad")

        before = transactions(pgbouncer)
        consumer = pgq.Consumer(
            engine,
            GROUP,
            handle,
            workers=8,
            name="through-pgbouncer",
            max_attempts=2,
            **FAST,
        )
        summary = consumer.run(until_empty=True, wait_retries=10)

        assert {mid: handled[mid] for mid in good} == dict.fromkeys(good, 1)
        assert {mid: handled[mid] for mid in bad} == dict.fromkeys(bad, 2)  # a retry, then dead
        assert set(handled) == {*good, *bad}
        assert (summary.done, summary.retried, summary.dead) == (300, 5, 5), summary
        assert (summary.refused, summary.reclaimed) == (0, 0), summary
        assert summary.stop_reason == "empty", summary
        assert consumer.clean
        assert transactions(pgbouncer) > before, "the member's work did not go through the pooler"

        direct = pgq.connect(pgbouncer.direct_dsn, schema=schema)
        try:
            found = rows(direct, GROUP)
            assert {mid for mid, row in found.items() if row.state == "dead"} == set(bad)
            assert all(found[mid].attempts == 2 for mid in bad)
            assert pgq.status(direct, GROUP)["counts"]["ready"] == 0
        finally:
            direct.dispose()
    finally:
        engine.dispose()


@pytest.mark.parametrize("spelling", ["option", "env"])
def test_pgq_consume_drains_through_pgbouncer(pgbouncer, orders, pgq_env, tmp_path, spelling):
    ids = pgq.publish_many(orders, "orders", [{"n": n} for n in range(50)])
    env = consumer_env(pgq_env, tmp_path, PGQ_POLL_INTERVAL="0.1")
    del env["PGQ_DSN"]
    if spelling == "option":
        root = ["--dsn", pgbouncer.dsn, "--session-dsn", pgbouncer.direct_dsn]
    else:
        root = []
        env.update(PGQ_DSN=pgbouncer.dsn, PGQ_SESSION_DSN=pgbouncer.direct_dsn)
    before = transactions(pgbouncer)

    proc = subprocess.run(
        [*PGQ, *root, "consume", GROUP, "--handler", "handlers:record", "--until-empty"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert proc.returncode == 0, proc.stderr
    assert sorted(read_ids(tmp_path, "handled")) == sorted(ids)
    status = pgq.status(orders, GROUP)
    assert (status["counts"]["done"], status["counts"]["dead"], status["lag"]) == (50, 0, 0)
    assert transactions(pgbouncer) > before, "the member's work did not go through the pooler"


def test_the_session_connection_goes_to_the_server_itself(pgbouncer, orders, schema):
    name = "idle-member"
    prefix = f"pgq/{GROUP}/{name}/"
    engine = pgq.connect(pgbouncer.dsn, session_dsn=pgbouncer.direct_dsn, schema=schema)
    consumer = pgq.Consumer(engine, GROUP, lambda msg: None, workers=2, name=name, **FAST)
    try:
        consumer.start()  # its own threads; idle: nothing is published

        def direct_sessions() -> list[int]:
            with psycopg.connect(pgbouncer.direct_dsn, autocommit=True) as conn:
                found = conn.execute(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name = %s",
                    (prefix + "session",),
                ).fetchall()
            return [pid for (pid,) in found]

        def pooled_names() -> set[str]:
            return {
                str(row["application_name"])
                for row in pgbouncer.show("CLIENTS")
                if str(row["application_name"] or "").startswith(prefix)
            }

        pids = wait_until(direct_sessions, 10, f"a backend named {prefix}session")
        assert len(pids) == 1, pids
        # a backend of its own, not one of the pooler's server connections
        assert pids[0] not in pgbouncer.server_pids()
        # the member's other connections are the pooler's clients; the session is not
        names = wait_until(pooled_names, 10, f"a client of the pooler named {prefix}...")
        assert prefix + "session" not in names, names
        # the same backend still, once the member has polled through the pooler a while
        polled = transactions(pgbouncer)
        wait_until(lambda: transactions(pgbouncer) >= polled + 10, 10, "the member's polls")
        assert direct_sessions() == pids
    finally:
        consumer.stop(timeout=10)
        engine.dispose()
    assert consumer.clean
