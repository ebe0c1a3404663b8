"""The `pgq` command: real subprocesses for exit codes and concurrency, CliRunner elsewhere."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner, Result
from helpers import PGQ, assert_usage_error, invoke
from sqlalchemy import Engine, func, select

from pgq import schema as t
from pgq.cli import cli


def run(
    env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real `pgq` command."""
    return subprocess.run(
        [*PGQ, *args], env=env, input=stdin, capture_output=True, text=True, timeout=60
    )


def messages(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(t.message)) or 0)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_init_by_two_processes_at_once(pgq_env):
    procs = [
        subprocess.Popen(
            [*PGQ, "init"], env=pgq_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("Traceback" not in err for _, err in outs)
    # the schema works afterwards
    ok(invoke(pgq_env, "topic", "create", "orders"))
    ok(invoke(pgq_env, "subscribe", "billing", "orders"))
    assert ok(invoke(pgq_env, "publish", "orders", '{"n": 1}')).stdout.strip().isdigit()
    status = json.loads(ok(invoke(pgq_env, "status", "billing", "--json")).stdout)
    assert status["counts"]["ready"] == 1
    ok(invoke(pgq_env, "init"))  # and again: nothing to do


def test_topic_subscribe_publish_and_status_json(orders, pgq_env):
    one = ok(invoke(pgq_env, "publish", "orders", '{"n": 1}', "--key", "k"))
    ids = [int(one.stdout)]
    batch = ok(invoke(pgq_env, "publish", "orders", stdin='{"n": 2}\n\n[3]\n"four"\n'))
    ids += [int(x) for x in batch.stdout.split()]
    dash = ok(invoke(pgq_env, "publish", "orders", "-", stdin="5\n"))
    ids += [int(x) for x in dash.stdout.split()]
    assert len(ids) == 5 and ids == sorted(ids)
    assert messages(orders) == 5
    ok(invoke(pgq_env, "subscribe", "late", "orders", "--from", "latest"))

    s = json.loads(ok(invoke(pgq_env, "status", "billing", "--json")).stdout)
    assert set(s) >= {
        "group",
        "topic",
        "committed",
        "counts",
        "totals",
        "lag",
        "breaker",
        "members",
    }
    assert (s["group"], s["topic"]) == ("billing", "orders")
    assert s["committed"] is None or isinstance(s["committed"], int)
    assert s["counts"] == {"ready": 5, "leased": 0, "done": 0, "dead": 0, "dead_systemic": 0}
    assert s["totals"] == {"reclaimed": 0, "released": 0, "refunded": 0}
    assert s["lag"] == 5
    assert set(s["breaker"]) >= {"state", "since", "prober", "epoch"}
    assert s["breaker"]["state"] == "CLOSED" and s["breaker"]["epoch"] == 0
    assert s["breaker"]["prober"] is None
    assert isinstance(s["breaker"]["since"], str) and s["breaker"]["since"].endswith("+00:00")
    assert s["members"] == []

    every = json.loads(ok(invoke(pgq_env, "status", "--json")).stdout)
    assert [(g["group"], g["lag"]) for g in every["groups"]] == [("billing", 5), ("late", 0)]
    human = ok(invoke(pgq_env, "status", "billing")).stdout
    assert "billing" in human and "ready 5" in human and "CLOSED" in human
    assert "billing" in ok(invoke(pgq_env, "status")).stdout


def test_members_breaker_and_dead(orders, pgq_env):
    assert json.loads(ok(invoke(pgq_env, "members", "billing", "--json")).stdout) == []
    b = json.loads(ok(invoke(pgq_env, "breaker", "billing", "--json")).stdout)
    assert (b["state"], b["epoch"], b["prober"], b["history"]) == ("CLOSED", 0, None, [])
    assert b["probes"] == []
    assert json.loads(ok(invoke(pgq_env, "dead", "billing", "--json", "--limit", "5")).stdout) == []
    assert "no members" in ok(invoke(pgq_env, "members", "billing")).stdout
    human = ok(invoke(pgq_env, "breaker", "billing")).stdout
    assert "CLOSED" in human and "probes: none" in human
    assert "no dead rows" in ok(invoke(pgq_env, "dead", "billing")).stdout


@pytest.mark.parametrize(
    ("args", "stdin", "contains"),
    [
        (("publish", "nope", "{}"), None, "unknown topic 'nope'"),
        (("status", "nope"), None, "unknown group 'nope'"),
        (("members", "nope"), None, "unknown group"),
        (("dead", "nope"), None, "unknown group"),
        (("breaker", "nope"), None, "unknown group"),
        (("publish", "orders", "{bad"), None, "invalid JSON"),
        (("publish", "orders", "NaN"), None, "invalid JSON"),
        (("publish", "orders"), '{"n": 1}\n{"n": 2}\n\n{"n": 3\n', "line 4: invalid JSON"),
        (("publish", "orders", "-"), '{"n": 1}\n\xff\n', "line 2: invalid JSON"),
        (("topic", "create", "bad name"), None, "invalid topic name"),
        (("subscribe", "g", "nope"), None, "unknown topic"),
        (("subscribe", "billing", "other"), None, "unknown topic"),
        (("--dsn", "not a dsn =", "status"), None, "invalid database address"),
        (("--schema", "Bad-Schema", "status"), None, "invalid schema name"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(orders, pgq_env, args, stdin, contains):
    result = invoke(pgq_env, *args, stdin=stdin)
    assert isinstance(result.exception, SystemExit), result.exception
    assert_usage_error(result.exit_code, result.stderr, contains=contains)
    assert result.stdout == ""
    assert messages(orders) == 0


def test_bad_dsn_and_bad_batch_exit_2_in_a_real_process(orders, pgq_env):
    for dsn in ("host=/nonexistent dbname=x", "not a dsn ="):
        proc = run(pgq_env, "--dsn", dsn, "status")
        assert_usage_error(proc.returncode, proc.stderr)
    proc = run(pgq_env, "publish", "orders", stdin='{"n": 1}\n{"n": 2}\nnot json\n')
    assert_usage_error(proc.returncode, proc.stderr, contains="line 3: invalid JSON")
    assert proc.stdout == ""
    assert messages(orders) == 0


def test_schema_missing_and_config_error(pgq_env, tmp_path):
    result = invoke(pgq_env, "status")  # fresh schema, no `pgq init` yet
    assert_usage_error(result.exit_code, result.stderr, contains="pgq init")
    bad = tmp_path / "pgq.toml"
    bad.write_text("[breaker]\nmember_ttl = -1\n")
    result = invoke(pgq_env, "--config", str(bad), "status")
    assert_usage_error(result.exit_code, result.stderr, contains="member_ttl")


def test_usage_errors_from_click_exit_2(pgq_env):
    assert invoke(pgq_env, "subscribe", "g", "t", "--from", "middle").exit_code == 2
    assert invoke(pgq_env, "no-such-command").exit_code == 2


def test_server_status_reports_a_stopped_server(tmp_path):
    result = CliRunner().invoke(
        cli, ["server", "status", "--json"], env={"PGQ_HOME": str(tmp_path)}
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["running"] is False and data["pid"] is None
    stop = CliRunner().invoke(cli, ["server", "stop"], env={"PGQ_HOME": str(tmp_path)})
    assert (stop.exit_code, stop.stdout.strip()) == (0, "not running")


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://postgres:S3CRETpw@[::1]x:5432/postgres",
        "postgresql://postgres:S3C%zzRETpw@localhost/postgres",
        "host=localhost password=S3CRETpw sslmode=nope-nope x",
    ],
)
def test_a_bad_dsn_is_refused_without_repeating_its_password(pgq_env, dsn):
    """Failed on d54e659 (found by an attack): libpq's message quoted the address."""
    for args in (("--dsn", dsn, "status"), ("--dsn", dsn, "check", "g")):
        result = invoke(pgq_env, *args)
        assert result.exit_code in (2, 3)
        assert "S3C" not in result.output and "RETpw" not in result.output
