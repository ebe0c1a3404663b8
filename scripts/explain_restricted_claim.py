"""EXPLAIN (ANALYZE, BUFFERS) of the claim and of a publish as unrestricted and
restricted roles (decision 0034): not a benchmark, one statement's plan and time.

A fresh schema `grants_explain` on `$PGQ_DSN` (default: the local test server):
topic `orders` with groups `billing` and `shipping` (20,000 messages, so 20,000
ready rows in each group), topic `payroll` with group `hr` (5,000). Roles
`gx_open` (`pgq grant --consumer`) and `gx_only` (`--consumer --group billing`).
Claims 100 rows of `billing` (rolled back each time) as `gx_open` before any
restriction exists (no row-level security), then, after `gx_only`'s grant,
as the owner, `gx_open` and `gx_only` in turn, round after round (`TIMING
OFF`); prints the median and minimum execution time of each, then one plan of
each with per-node timings.

Then the same for a publish of 100 messages to `orders` (two groups: 100
messages and 200 delivery rows, rolled back) as `gx_pub_open` (`--producer`)
and `gx_pub_only` (`--producer --topic orders`).

    PYTHONPATH=. python scripts/explain_restricted_claim.py [ROUNDS]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import statistics
import sys

import psycopg
from psycopg import sql

import pgq
from pgq.sql import claim as claim_sql
from pgq.sql import publish as publish_sql
from pgq.store import group_info, migrate
from pgq.store.connections import driver_sql
from pgq.store.privileges import grant

DSN = os.environ.get("PGQ_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
SCHEMA = "grants_explain"
ROLES = ("gx_open", "gx_only", "gx_pub_open", "gx_pub_only")


def fresh_roles() -> None:
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        for role in ROLES:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))


def explain(
    user: str | None, text: str, params: dict[str, object], timing: bool = False
) -> tuple[float, str]:
    """The execution time (ms) and the plan of one claim as `user`, rolled back;
    per-node timings only with `timing` (they cost more, the more nodes a plan has)."""
    conninfo = psycopg.conninfo.make_conninfo(DSN, **({"user": user} if user else {}))
    with psycopg.connect(conninfo) as conn:
        conn.execute("SET jit = off")  # as the hot path's connections run it
        options = "ANALYZE, BUFFERS" + ("" if timing else ", TIMING OFF")
        rows = conn.execute(f"EXPLAIN ({options}) {text}".encode(), params).fetchall()
        conn.rollback()
    plan = "\n".join(str(r[0]) for r in rows)
    found = re.search(r"Execution Time: ([\d.]+)", plan)
    assert found, plan
    return float(found.group(1)), plan


def main(rounds: int) -> None:
    fresh_roles()
    owner = pgq.connect(DSN, schema=SCHEMA)
    migrate(owner)
    pgq.create_topic(owner, "orders")
    pgq.create_topic(owner, "payroll")
    for group, topic in (("billing", "orders"), ("shipping", "orders"), ("hr", "payroll")):
        pgq.subscribe(owner, group, topic)
    for _ in range(20):
        pgq.publish_many(owner, "orders", [{"n": i, "pad": "x" * 100} for i in range(1000)])
    pgq.publish_many(owner, "payroll", [{"n": i} for i in range(5000)])
    with owner.begin() as conn:
        for name in ("delivery", "message"):
            conn.exec_driver_sql(f'ANALYZE "{SCHEMA}".{name}')
    grant(owner, "gx_open", "consumer")
    with owner.connect() as conn:
        text, defaults = driver_sql(conn, claim_sql.claim(100))
    params = {
        **defaults,
        "gid": group_info(owner, "billing").id,
        "member": "m",
        "token": -1,
        "lease": dt.timedelta(seconds=30),
    }
    times: dict[str, list[float]] = {}
    plans: dict[str, str] = {}
    for _ in range(rounds):
        times.setdefault("gx_open before", []).append(explain("gx_open", text, params)[0])
    plans["gx_open before"] = explain("gx_open", text, params, timing=True)[1]
    grant(owner, "gx_only", "consumer", groups=["billing"])
    users = {"owner": None, "gx_open": "gx_open", "gx_only": "gx_only"}
    for _ in range(rounds):
        for name, user in users.items():
            times.setdefault(name, []).append(explain(user, text, params)[0])
    for name, user in users.items():
        plans[name] = explain(user, text, params, timing=True)[1]
    for name, took in times.items():
        print(f"=== {name}: median {statistics.median(took):.3f} ms, min {min(took):.3f} ms")
    grant(owner, "gx_pub_open", "producer")
    grant(owner, "gx_pub_only", "producer", topics=["orders"])
    with owner.connect() as conn:
        text, defaults = driver_sql(conn, publish_sql.publish_batch())
    batch = json.dumps([{"n": i, "pad": "x" * 100} for i in range(100)])
    params = {
        **defaults,
        "topic": "orders",
        "payloads": batch,
        "key": None,
        "headers": None,
        "delay": dt.timedelta(0),
        "channel": publish_sql.notify_channel(SCHEMA),
    }
    publishers = {"publish as gx_pub_open": "gx_pub_open", "publish as gx_pub_only": "gx_pub_only"}
    for _ in range(rounds):
        for name, user in publishers.items():
            times.setdefault(name, []).append(explain(user, text, params)[0])
    for name, user in publishers.items():
        plans[name] = explain(user, text, params, timing=True)[1]
    for name, took in times.items():
        if name.startswith("publish"):
            print(f"=== {name}: median {statistics.median(took):.3f} ms, min {min(took):.3f} ms")
    for name, plan in plans.items():
        print(f"\n=== {name}\n{plan}")
    owner.dispose()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
