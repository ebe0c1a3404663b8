"""Attacks on the second signal of `pgq consume` (`Runtime.abort`, decision 0039):
it writes the queued outcomes through the acker's own write, on the `claims`
connection, and must exit 1 at once.

Found by attack:

- The second signal hangs when it comes during the shutdown's final pass. The
  final pass runs on `claims` in the main thread; a signal handler runs in that
  same thread, in the middle of the final pass's statement, and `abort` writes
  the outcomes the stuck acker left queued on that same connection: the link's
  lock is reentrant, so it gets the connection the final pass is still waiting
  on, and the driver's own lock (not reentrant) never comes. Here the final pass
  waits on a lock on the member row (an operator's transaction) while the acker
  waits on a lock on a delivery row; the process never exits.
- The second signal hangs while the network to the database is stalled (packets
  dropped, nothing reset): `abort` writes the queued outcomes on `claims` and
  releases the session lock on `session` with no bound on either (a statement
  sent into the stall waits for an answer, and a link another thread's stalled
  statement holds is waited for), so the process never exits.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from chaos.proxy import Proxy
from helpers import consumer_env, finish, read_ids, spawn_pgq, wait_until, waiting_on
from sqlalchemy import Engine, text

import pgq

pytestmark = pytest.mark.timeout(120)

SETTINGS = {
    "PGQ_LEASE": "5.0",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "2.0",
    "PGQ_POLL_INTERVAL": "0.1",
    "PGQ_SHUTDOWN_GRACE": "1.0",
}

PROMPT = 5.0
"""Seconds a second signal may take to end the process (it should be at once)."""


def _claims_waits_on(engine: Engine, member: str, blocker: int) -> bool:
    """Whether `member`'s `claims` connection waits on a lock backend `blocker` holds."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = :app"
                    " AND CAST(:pid AS int) = ANY(pg_blocking_pids(pid))"
                ),
                {"app": f"pgq/billing/{member}/claims", "pid": blocker},
            ).scalar_one()
        )


def test_a_second_signal_during_the_final_pass_exits_at_once(
    orders: Engine, schema: str, pgq_env: dict[str, str], tmp_path: Path, procs: list
) -> None:
    engine = orders
    first, *others = pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    env = consumer_env(pgq_env, tmp_path, TESTQ_TAG="a", **SETTINGS)
    args = ("consume", "billing", "--handler", "attack_writes_handlers:gated_each")
    a = spawn_pgq(env, *args, "--workers", "3", "--name", "a")
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 3, 30, "three handlers to start")
    blocker = engine.connect()
    tx = blocker.begin()
    try:
        pid = blocker.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        blocker.execute(
            text(f'SELECT 1 FROM "{schema}".delivery WHERE message_id = :id FOR UPDATE'),
            {"id": first},
        )
        (tmp_path / f"go-{first}").touch()
        wait_until(
            lambda: waiting_on(engine, pid, "WITH last AS%"),
            20,
            "the acker's write of the first outcome to wait on the test's row lock",
        )
        for mid in others:  # their outcomes queue behind the stuck write
            (tmp_path / f"go-{mid}").touch()
        wait_until(lambda: len(read_ids(tmp_path, "handled")) == 3, 20, "the other two handled")

        a.send_signal(signal.SIGTERM)
        # the final pass's `leave` will wait on the member row
        blocker.execute(
            text(f"SELECT 1 FROM \"{schema}\".member WHERE name = 'a' FOR UPDATE"),
        )
        wait_until(
            lambda: _claims_waits_on(engine, "a", pid),
            30,
            "the final pass (claims connection) to wait on the member row",
        )
        sent = time.monotonic()
        a.send_signal(signal.SIGTERM)
        code, _, stderr = finish(a, 2 * PROMPT)
        took = time.monotonic() - sent
    finally:
        tx.rollback()
        blocker.close()
    assert code == 1, stderr
    assert took < PROMPT, (took, stderr)


def test_a_second_signal_while_the_network_is_stalled_exits_at_once(
    orders: Engine, pgq_env: dict[str, str], pg_dsn: str, tmp_path: Path, procs: list
) -> None:
    engine = orders
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    with Proxy.for_dsn(pg_dsn) as proxy:
        env = consumer_env(pgq_env, tmp_path, TESTQ_TAG="a", PGQ_DSN=proxy.dsn(pg_dsn), **SETTINGS)
        args = ("consume", "billing", "--handler", "attack_writes_handlers:gated_each")
        log = tmp_path / "a.log"
        a = spawn_pgq(env, *args, "--workers", "3", "--name", "a", log=log)
        procs.append(a)
        wait_until(lambda: len(read_ids(tmp_path, "started")) == 3, 30, "three handlers to start")
        proxy.stall()
        for mid in ids:  # their outcomes go to an acker whose write the stall holds
            (tmp_path / f"go-{mid}").touch()
        wait_until(lambda: len(read_ids(tmp_path, "handled")) == 3, 20, "the three handled")
        a.send_signal(signal.SIGTERM)
        wait_until(
            lambda: "stopping on signal" in log.read_text(),
            10,
            "the first signal to be taken",
        )
        sent = time.monotonic()
        a.send_signal(signal.SIGTERM)
        try:
            code, _, _ = finish(a, 2 * PROMPT)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text()}") from None
        finally:
            proxy.resume()
        took = time.monotonic() - sent
    assert code == 1, log.read_text()
    assert took < PROMPT, (took, log.read_text())
