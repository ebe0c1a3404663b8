"""The audit trail holds up (issue 21, "day two").

A requeue or purge that matched nothing writes no row; `pgq audit` shows
relative times like every other command, never crashes on what a role that may
insert audit rows wrote there (text, `--json` and the dashboard), and records
the database role the insert ran as beside the OS user the client names.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any

import pytest
from helpers import across_groups, invoke, kill
from roles import job_role
from sqlalchemy import Engine, func, select, text

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.store import purge, requeue
from pgq.web import dashboard_server

GROUP = "billing"
DEEP = "[" * 5000 + "1" + "]" * 5000


def ok(result: Any) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return str(result.stdout)


def count(engine: Engine, table: Any) -> int:
    with across_groups(engine) as conn:  # a test's count, over every group
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def gid_of(engine: Engine, group: str) -> int:
    with engine.connect() as conn:
        g = t.consumer_group
        return int(conn.execute(select(g.c.id).where(g.c.name == group)).scalar_one())


def test_a_requeue_or_purge_that_matched_nothing_writes_no_audit_row(orders, pgq_env):
    """Reported: `requeue --all` with no dead row wrote "requeue 0"."""
    assert ok(invoke(pgq_env, "requeue", GROUP, "--all", "--reason", "x")) == "requeued 0\n"
    assert ok(invoke(pgq_env, "purge", GROUP, "--dead", "--reason", "x")) == "purged 0\n"
    assert requeue(orders, GROUP, all_dead=True, reason="x").audit_id is None
    assert purge(orders, GROUP, older_than=60, reason="x").audit_id is None
    assert count(orders, t.audit) == 0
    assert ok(invoke(pgq_env, "audit", GROUP)) == "no audit rows\n"
    ids = pgq.publish_many(orders, "orders", [1, 2])
    kill(orders, ids, "message")
    assert requeue(orders, GROUP, all_dead=True, reason="x").audit_id is not None
    assert count(orders, t.audit) == 1


def test_audit_prints_relative_times_like_every_other_command(orders, pgq_env):
    """Reported: `pgq audit` printed the absolute time."""
    ids = pgq.publish_many(orders, "orders", [1])
    kill(orders, ids, "message")
    requeue(orders, GROUP, ids, reason="x")
    [at] = [a["at"] for a in monitor.audit(orders, GROUP)]
    [header, line] = ok(invoke(pgq_env, "audit", GROUP)).splitlines()
    assert header.split()[:2] == ["ID", "AT"]
    assert at not in line and at[:10] not in line
    assert line.split()[1:4] in (["0", "s", "ago"], ["1", "s", "ago"], ["2", "s", "ago"])


SHAPES = {
    "object": '{"a": 1}',
    "null": "null",
    "string": '"12,13"',
    "number": "42",
    "array of strings": '["1", "2"]',
    "nested arrays": DEEP,
    "huge": json.dumps(list(range(200_000))),
}
"""Every shape of `message_ids` an admin role can insert (the column is any jsonb)."""


def insert_audit_rows(engine: Engine, schema: str, shapes: dict[str, str]) -> None:
    """One audit row of group `GROUP` per shape, as an admin role can insert it (its
    reason is the shape's name)."""
    gid = gid_of(engine, GROUP)
    with engine.begin() as conn:
        for shape, value in shapes.items():
            conn.execute(
                text(
                    f'INSERT INTO "{schema}".audit'
                    " (group_id, action, message_ids, count, reason, actor)"
                    " VALUES (:gid, 'requeue', CAST(:ids AS jsonb), 3, :shape, 'x@y')"
                ),
                {"gid": gid, "ids": value, "shape": shape},
            )


@pytest.mark.parametrize("shape", SHAPES)
def test_audit_never_crashes_on_what_the_table_holds(orders, pgq_env, schema, shape):
    """Reported: an object or a null in `message_ids` crashed `pgq audit` (exit 1)."""
    insert_audit_rows(orders, schema, {shape: SHAPES[shape]})
    [row] = json.loads(ok(invoke(pgq_env, "audit", GROUP, "--json")))
    assert row["reason"] == shape and row["count"] == 3
    [_header, line] = ok(invoke(pgq_env, "audit", GROUP)).splitlines()
    assert line.endswith(f"  {shape}") and len(line) < 200
    assert row == monitor.audit(orders, GROUP)[0]
    shown = {
        "object": ({"a": 1}, '{"a": 1}'),
        "null": (None, " - "),
        "string": ("12,13", '"12,13"'),
        "number": (42, " 42 "),
        "array of strings": (["1", "2"], '["1", "2"]'),
        "nested arrays": (None, " ? "),
        "huge": (list(range(200_000)), "0,1,2,3,4 (+199995)"),
    }
    value, cell = shown[shape]
    assert row["message_ids"] == value and cell in line
    assert (row["unreadable"] is not None) == (shape == "nested arrays")


def test_the_dashboard_shows_every_shape_of_audit_row(orders, schema):
    insert_audit_rows(orders, schema, SHAPES)
    server = dashboard_server(orders, host="127.0.0.1", port=0)
    server.start()
    try:
        url = urllib.parse.urlsplit(server.url)
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
        conn.request("GET", f"/groups/{GROUP}")
        answer = conn.getresponse()
        body = answer.read().decode()
        conn.close()
    finally:
        server.close()
    assert answer.status == 200, body[:500]
    assert all(shape in body for shape in SHAPES)
    assert "<th>role</th>" in body  # rows written without one show `-`


def test_the_audit_row_records_the_database_role_beside_the_os_user(orders, pg_dsn, schema):
    """LOGNAME can fake the OS user; the role is the session's, taken by the insert."""
    ids = pgq.publish_many(orders, "orders", [1, 2])
    kill(orders, ids, "message")
    with job_role(pg_dsn, schema, "admin") as (role, dsn):
        env = {"PGQ_DSN": dsn, "PGQ_SCHEMA": schema}
        out = invoke(env, "requeue", GROUP, "--id", str(ids[0]), "--reason", "x", LOGNAME="root")
        assert ok(out) == "requeued 1\n"
        [row] = monitor.audit(orders, GROUP)
        assert row["actor"].startswith("root@") and row["role"] == role
        lines = ok(invoke(env, "audit", GROUP)).splitlines()
        assert lines[0].split()[4:6] == ["ACTOR", "ROLE"] and role in lines[1]
        # a client cannot name another role: the statement takes no role parameter
        admin = pgq.connect(dsn, schema=schema)
        try:
            purge(admin, GROUP, reason="y", actor="someone@else")
        finally:
            admin.dispose()
    newest = monitor.audit(orders, GROUP)[0]
    assert (newest["actor"], newest["role"]) == ("someone@else", role)
