"""The committed frontier on Citus: today's rule against the per-shard rule of
docs/decisions/0023-citus-placement.md, on a real cluster.

    python scripts/citus_frontier_demo.py [--dsn postgresql://postgres@127.0.0.1:9701/postgres]

Drops and recreates the schema `pgq` (throwaway clusters only). For each group
(one per shard placement we can find on each worker) it plays the out-of-order
commit that the frontier exists for:

1. publisher A begins and publishes one message (not committed yet);
2. publisher B publishes one message and commits;
3. every visible ready row of the group is marked done (B's row);
4. the frontier advances;
5. A commits.

The frontier must not pass A's row (it is ready); and it should reach B's row once
A has committed and the frontier advances again. Run twice: with today's schema
(`delivery.xid` is the coordinator's xid, the group row a reference table) and
with the proposal (a BEFORE INSERT trigger stores the shard node's own xid, the
frontier lives in a table co-located with `delivery`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from citus_findings import compiled, distribute, summary

import pgq
from pgq.schema import XID8
from pgq.sql import frontier, publish

_state = MetaData(schema="pgq")
group_frontier = Table(
    "group_frontier",
    _state,
    Column("id", Integer, primary_key=True),
    Column("committed_xid", XID8(), nullable=False, server_default=text("'0'::xid8")),
    Column("committed_id", BigInteger),
    Column("done_pruned", BigInteger, nullable=False, server_default=text("0")),
)

LOCAL_XID = (
    """CREATE FUNCTION pgq.delivery_local_xid() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        NEW.xid := pg_current_xact_id();  -- this transaction's xid on the shard's node
        RETURN NEW;
    END $$""",
    "SET citus.enable_unsafe_triggers = on",
    """CREATE TRIGGER delivery_local_xid BEFORE INSERT ON pgq.delivery
    FOR EACH ROW EXECUTE FUNCTION pgq.delivery_local_xid()""",
)


def advance_statement(proposal: bool) -> Any:
    """Today's advance (pgq.sql.frontier) over the reference group row, or the same
    statement over the co-located frontier table."""
    if not proposal:
        return frontier.advance_frontier()
    saved = frontier.g
    frontier.g = group_frontier  # type: ignore[assignment]
    try:
        return frontier.advance_frontier.__wrapped__()
    finally:
        frontier.g = saved


def setup(dsn: str, proposal: bool) -> dict[int, int]:
    """Fresh schema, one topic, groups until both workers hold one; returns gid -> port."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA IF EXISTS pgq CASCADE")
    engine = pgq.connect(dsn, schema="pgq", pool_size=None)
    pgq.migrate(engine)
    with psycopg.connect(dsn, autocommit=True) as c:
        distribute(c, "reference")
        if proposal:
            _state.create_all(psycopg_engine(dsn))
            c.execute(
                "SELECT create_distributed_table('pgq.group_frontier', 'id',"
                " colocate_with => 'pgq.delivery')"
            )
            for command in LOCAL_XID:
                c.execute(command)
    pgq.create_topic(engine, "t")
    ports: dict[int, int] = {}
    with psycopg.connect(dsn, autocommit=True) as c:
        for n in range(1, 20):
            pgq.subscribe(engine, f"g{n}", "t")
            gid = c.execute(
                "SELECT id FROM pgq.consumer_group WHERE name = %s", [f"g{n}"]
            ).fetchone()
            assert gid is not None
            port = c.execute(
                "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid ="
                " get_shard_id_for_distribution_column('pgq.delivery', %s)",
                [gid[0]],
            ).fetchone()
            assert port is not None
            if port[0] not in ports.values():
                ports[gid[0]] = port[0]
            if proposal:
                c.execute("INSERT INTO pgq.group_frontier (id) VALUES (%s)", [gid[0]])
            if len(ports) == 2:
                break
    engine.dispose()
    return ports


def psycopg_engine(dsn: str) -> Any:
    return pgq.connect(dsn, schema="pgq", pool_size=None)


def publish_one(conn: psycopg.Connection[Any], n: int) -> None:
    params = {
        "topic": "t",
        "payloads": f"[{n}]",
        "key": None,
        "headers": None,
        "delay": "0 seconds",
        "channel": "pgq.pgq",
    }
    # not `lock_topic_for_publish`: on Citus a row lock on the reference table `topic`
    # locks the whole table (B would wait for A); the proposal's advisory lock instead
    conn.execute("SELECT pg_advisory_xact_lock_shared(hashtextextended('pgq:topic:t', 0))")
    conn.execute(*compiled(publish.publish_batch(), params))


def frontier_of(c: psycopg.Connection[Any], gid: int, proposal: bool) -> tuple[Any, Any]:
    table = "pgq.group_frontier" if proposal else "pgq.consumer_group"
    row = c.execute(
        f"SELECT committed_xid, committed_id FROM {table} WHERE id = %s", [gid]
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def play(dsn: str, proposal: bool, skew: int) -> int:
    ports = setup(dsn, proposal)
    advance = advance_statement(proposal)
    violations = 0
    with psycopg.connect(dsn, autocommit=True) as c:
        cx = c.execute("SELECT pg_current_xact_id()").fetchone()
        ahead = max(ports.values())
        with psycopg.connect(dsn.replace(":9701", f":{ahead}"), autocommit=True) as w:
            # Worker xid counters drift apart from the coordinator's in any real
            # cluster (their own local work, other databases, shard moves); make the
            # drift explicit: one worker ahead of the coordinator by `skew` or more.
            while True:
                wx = w.execute("SELECT pg_current_xact_id()").fetchone()
                if wx and cx and int(wx[0]) > int(cx[0]) + skew:
                    break
        for port in sorted(set(ports.values())):
            with psycopg.connect(dsn.replace(":9701", f":{port}"), autocommit=True) as w:
                wx = w.execute("SELECT pg_current_xact_id()").fetchone()
            cx = c.execute("SELECT pg_current_xact_id()").fetchone()
            print(
                f"   node {port}: its next xid {wx[0] if wx else '?'};"
                f" coordinator's {cx[0] if cx else '?'}"
            )
        a = psycopg.connect(dsn)
        publish_one(a, 1)  # A: published, not committed
        with psycopg.connect(dsn) as b:
            publish_one(b, 2)  # B: committed
            b.commit()
        for gid in ports:
            c.execute(
                "UPDATE pgq.delivery SET state = 'done' WHERE group_id = %s AND state = 'ready'",
                [gid],
            )
            with c.transaction():
                c.execute(*compiled(frontier.without_jit(), {}))
                c.execute(*compiled(advance, {"gid": gid}))
        a.commit()
        a.close()
        for gid, port in ports.items():
            cxid, cid = frontier_of(c, gid, proposal)
            rows = c.execute(
                "SELECT message_id, xid, state FROM pgq.delivery WHERE group_id = %s ORDER BY 1",
                [gid],
            ).fetchall()
            passed = [
                r
                for r in rows
                if r[2] in ("ready", "leased")
                and cid is not None
                and (int(r[1]), r[0]) <= (int(cxid), cid)
            ]
            violations += len(passed)
            print(
                f"   group {gid} on node {port}: rows (message, xid, state) {rows};"
                f" frontier after the race ({cxid}, {cid});"
                f" {f'PASSED unresolved {passed}' if passed else 'no unresolved row passed'}"
            )
            c.execute(
                "UPDATE pgq.delivery SET state = 'done' WHERE group_id = %s AND state = 'ready'",
                [gid],
            )
            end = max((int(r[1]), r[0]) for r in rows)  # where the frontier should end
            if cid is not None:
                end = max(end, (int(cxid), cid))
            with c.transaction():
                c.execute(*compiled(frontier.without_jit(), {}))
                c.execute(*compiled(advance, {"gid": gid}))
            after = frontier_of(c, gid, proposal)
            last = end[1]
            print(
                f"   group {gid}: all resolved, frontier now {after}:"
                f" {'reached the last message' if after[1] == last else f'STALLED before {last}'}"
            )
        plan = c.execute(*compiled_explain(advance, {"gid": next(iter(ports))})).fetchall()
        print(f"   advance plan: {summary([r[0] for r in plan])}")
    return violations


def compiled_explain(stmt: Any, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    sql, params = compiled(stmt, params)
    return "EXPLAIN (COSTS OFF) " + sql, params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:9701/postgres")
    ap.add_argument("--skew", type=int, default=200, help="xids one worker is made to lead by")
    args = ap.parse_args()
    print("== today: delivery.xid = the coordinator's xid, frontier in consumer_group (reference)")
    today = play(args.dsn, proposal=False, skew=args.skew)
    print("== proposal: delivery.xid = the shard node's xid (trigger), frontier co-located")
    proposed = play(args.dsn, proposal=True, skew=args.skew)
    print(f"== unresolved rows passed: today {today}, proposal {proposed}")


if __name__ == "__main__":
    main()
