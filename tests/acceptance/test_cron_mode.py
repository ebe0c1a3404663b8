"""`pgq consume --until-empty` as cron runs it: exit 75 when a breaker is open.

DESIGN §7: 0 when drained, 75 (EX_TEMPFAIL) when the group's or its own local
breaker is open, or the database cannot be reached within `lease` seconds.
A run that finds the group OPEN and wins the probe election probes once if the
stored probe time has come: success closes, reconciles and drains.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import consumer_env, finish, rows, spawn_pgq
from sqlalchemy import Engine

import pgq

pytestmark = pytest.mark.slow

SETTINGS = {
    "PGQ_WORKERS": 2,
    "PGQ_LEASE": 2,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_RETRY_BACKOFF": 0.02,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": 1.0,
    "PGQ_BREAKER_WINDOW": 4,
    "PGQ_BREAKER_MIN_CALLS": 4,
}


def cron_run(pgq_env: dict[str, str], out: Path, **extra: object) -> tuple[int, str, float]:
    env = consumer_env(pgq_env, out, **{**SETTINGS, **extra})
    started = time.monotonic()
    proc = spawn_pgq(env, "consume", "g", "--handler", "outage_handlers:flaky", "--until-empty")
    code, _, err = finish(proc, 60)
    return code, err, time.monotonic() - started


@pytest.fixture
def opened(engine: Engine) -> Engine:
    """Group `g` with work to do and its breaker OPEN (as an outage left it)."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(50)])
    with engine.begin() as conn:
        schema = engine.get_execution_options()["schema_translate_map"]["pgq"]
        conn.exec_driver_sql(
            f"UPDATE \"{schema}\".delivery SET state = 'dead', error_class = 'systemic',"
            " error_epoch = 1, attempts = 5, refundable_attempts = 5 WHERE message_id <= 10"
        )
        conn.exec_driver_sql(f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = 1")
    return engine


def set_probe_due(engine: Engine, due: bool) -> None:
    schema = engine.get_execution_options()["schema_translate_map"]["pgq"]
    when = "now() - interval '1 second'" if due else "now() + interval '1 hour'"
    with engine.begin() as conn:
        conn.exec_driver_sql(f'UPDATE "{schema}".breaker SET next_probe_at = {when}')


def test_open_group_with_probe_not_due_exits_75_at_once(opened, pgq_env, tmp_path):
    set_probe_due(opened, due=False)
    code, err, took = cron_run(pgq_env, tmp_path)
    assert code == 75, err
    assert took < 15
    s = pgq.status(opened, "g")
    assert s["breaker"]["state"] == "OPEN"
    assert s["counts"]["leased"] == 0 and s["counts"]["done"] == 0


def test_open_group_probe_due_and_failing_exits_75(opened, pgq_env, tmp_path):
    set_probe_due(opened, due=True)
    (tmp_path / "down").touch()
    code, err, _ = cron_run(pgq_env, tmp_path)
    assert code == 75, err
    s = pgq.status(opened, "g")
    assert s["breaker"]["state"] == "OPEN"
    assert s["counts"]["done"] == 0 and s["counts"]["leased"] == 0


def test_open_group_probe_due_and_succeeding_closes_refunds_and_drains(opened, pgq_env, tmp_path):
    set_probe_due(opened, due=True)
    code, err, _ = cron_run(pgq_env, tmp_path)
    assert code == 0, err
    s = pgq.status(opened, "g")
    assert s["breaker"]["state"] == "CLOSED"
    assert s["lag"] == 0 and s["counts"]["dead"] == 0 and s["counts"]["done"] == 50
    assert s["totals"]["refunded"] >= 9  # the ten dead rows, less one if it was the probe


def test_local_breaker_open_exits_75_and_leaves_rows_ready(engine, pgq_env, tmp_path):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(100)])
    code, err, _ = cron_run(pgq_env, tmp_path, TESTQ_BAD=1, PGQ_MAX_ATTEMPTS=50)
    assert code == 75, err
    s = pgq.status(engine, "g")
    assert s["breaker"]["state"] == "CLOSED"  # alone it cannot open the group (min_members 2)
    assert s["counts"]["leased"] == 0 and s["counts"]["dead"] == 0
    assert all(r.state == "ready" for r in rows(engine, "g").values())


def test_unreachable_database_gives_up_after_lease_with_75(pgq_env, tmp_path):
    env = {**pgq_env, "PGQ_DSN": "postgresql://postgres@127.0.0.1:9/postgres?connect_timeout=1"}
    code, err, took = cron_run(env, tmp_path, PGQ_LEASE=1)
    assert code == 75, err
    assert "Traceback" not in err
    assert took < 20
