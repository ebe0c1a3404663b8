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
import random
import sys
import threading
import time
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


def setup(dsn: str, proposal: bool, topics: int = 1, per_topic: int = 0) -> dict[int, int]:
    """Fresh schema; returns the groups to watch, gid -> port of their node.

    By default one topic `t` and groups until both workers hold one (one watched
    per worker); with `per_topic`, `topics` topics (`t`, `t1`, ...) with that many
    groups each, all watched."""
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
    names = topic_names(topics)
    for name in names:
        pgq.create_topic(engine, name)
    ports: dict[int, int] = {}
    with psycopg.connect(dsn, autocommit=True) as c:
        for n in range(1, 20 if not per_topic else topics * per_topic + 1):
            pgq.subscribe(engine, f"g{n}", names[(n - 1) % topics])
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
            if per_topic or port[0] not in ports.values():
                ports[gid[0]] = port[0]
            if proposal:
                c.execute("INSERT INTO pgq.group_frontier (id) VALUES (%s)", [gid[0]])
            if not per_topic and len(ports) == 2:
                break
    engine.dispose()
    return ports


def topic_names(topics: int) -> list[str]:
    return ["t", *(f"t{n}" for n in range(1, topics))]


def psycopg_engine(dsn: str) -> Any:
    return pgq.connect(dsn, schema="pgq", pool_size=None)


def publish_one(conn: psycopg.Connection[Any], n: int, topic: str = "t") -> None:
    params = {
        "topic": topic,
        "payloads": f"[{n}]",
        "key": None,
        "headers": None,
        "delay": "0 seconds",
        "channel": "pgq.pgq",
    }
    # not `lock_topic_for_publish`: on Citus a row lock on the reference table `topic`
    # locks the whole table (B would wait for A); the proposal's advisory lock instead
    conn.execute(
        "SELECT pg_advisory_xact_lock_shared(hashtextextended('pgq:topic:' || %s, 0))", [topic]
    )
    conn.execute(*compiled(publish.publish_batch(), params))


def frontier_of(c: psycopg.Connection[Any], gid: int, proposal: bool) -> tuple[Any, Any]:
    table = "pgq.group_frontier" if proposal else "pgq.consumer_group"
    row = c.execute(
        f"SELECT committed_xid, committed_id FROM {table} WHERE id = %s", [gid]
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def node_dsn(dsn: str, port: int) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["port"] = str(port)
    return psycopg.conninfo.make_conninfo(**params)


def make_skew(dsn: str, ports: dict[int, int], skew: int) -> None:
    """Worker xid counters drift apart from the coordinator's in any real cluster
    (their own local work, other databases, two-phase commits); make the drift
    explicit: the worker with the highest port leads the coordinator by `skew`."""
    with psycopg.connect(dsn, autocommit=True) as c:
        cx = c.execute("SELECT pg_current_xact_id()").fetchone()
    with psycopg.connect(node_dsn(dsn, max(ports.values())), autocommit=True) as w:
        while True:
            wx = w.execute("SELECT pg_current_xact_id()").fetchone()
            if wx and cx and int(wx[0]) > int(cx[0]) + skew:
                break


def play(dsn: str, proposal: bool, skew: int) -> int:
    ports = setup(dsn, proposal)
    advance = advance_statement(proposal)
    violations = 0
    with psycopg.connect(dsn, autocommit=True) as c:
        make_skew(dsn, ports, skew)
        for port in sorted(set(ports.values())):
            with psycopg.connect(node_dsn(dsn, port), autocommit=True) as w:
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


def stress(
    dsn: str, proposal: bool, skew: int, seconds: float, topics: int = 1, per_topic: int = 0
) -> tuple[int, int, int]:
    """Concurrent publishers (random commit order), an acker and one advancer per
    group for `seconds`; returns (advances, distinct unresolved rows found behind a
    frontier, groups whose frontier did not reach their last row at the end).

    The acker only acks rows ahead of the frontier, so a row the frontier passed
    while it was still invisible stays ready behind it and is counted."""
    ports = setup(dsn, proposal, topics, per_topic)
    make_skew(dsn, ports, skew)
    advance = advance_statement(proposal)
    names = topic_names(topics)
    table = "pgq.group_frontier" if proposal else "pgq.consumer_group"
    behind = (
        f"(xid, message_id) <= (SELECT committed_xid, coalesce(committed_id, 0) FROM {table}"
        " WHERE id = %(g)s)"
    )
    stop = threading.Event()
    passed: set[tuple[int, int]] = set()
    advances = [0]
    published = [0]

    def publisher(seed: int) -> None:
        rnd = random.Random(seed)
        with psycopg.connect(dsn) as conn:
            while not stop.is_set():
                publish_one(conn, rnd.randrange(1000), rnd.choice(names))
                time.sleep(rnd.random() * 0.05)  # commits land in random order
                conn.commit()
                published[0] += 1

    def acker() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                for g in ports:
                    conn.execute(
                        "UPDATE pgq.delivery SET state = 'done' WHERE group_id = %(g)s"
                        f" AND state = 'ready' AND NOT {behind}",
                        {"g": g},
                    )
                time.sleep(0.01)

    def advancer(g: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                with conn.transaction():
                    conn.execute(*compiled(frontier.without_jit(), {}))
                    conn.execute(*compiled(advance, {"gid": g}))
                advances[0] += 1
                for row in conn.execute(
                    "SELECT message_id FROM pgq.delivery WHERE group_id = %(g)s"
                    f" AND state IN ('ready', 'leased') AND {behind}",
                    {"g": g},
                ):
                    passed.add((g, row[0]))
                time.sleep(0.02)

    threads = [threading.Thread(target=publisher, args=(n,)) for n in range(3)]
    threads += [threading.Thread(target=acker)]
    threads += [threading.Thread(target=advancer, args=(g,)) for g in ports]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(30)
    stalled = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        for g in ports:  # the end: everything acked; the frontier must reach the last row
            conn.execute(
                "UPDATE pgq.delivery SET state = 'done' WHERE group_id = %(g)s"
                f" AND state = 'ready' AND NOT {behind}",
                {"g": g},
            )
            last = conn.execute(
                "SELECT max(id) FROM pgq.message",
            ).fetchone()
            for _ in range(2):
                with conn.transaction():
                    conn.execute(*compiled(frontier.without_jit(), {}))
                    conn.execute(*compiled(advance, {"gid": g}))
            left = conn.execute(
                "SELECT count(*) FROM pgq.delivery WHERE group_id = %(g)s"
                f" AND state = 'done' AND NOT {behind}",
                {"g": g},
            ).fetchone()
            if left and left[0]:
                stalled += 1
            print(
                f"   group {g} on node {ports[g]}: {left[0] if left else '?'} done rows still"
                f" ahead of its frontier at the end (last message {last[0] if last else '?'})"
            )
    print(f"   {published[0]} publishes, {advances[0]} advances")
    return advances[0], len(passed), stalled


def shard_move(dsn: str, skew: int) -> int:
    """The proposal across a shard move: the group whose shard is on the worker ahead
    moves to the worker behind (`block_writes`: no logical replication needed); then
    one publish. Returns the unresolved rows found behind the frontier."""
    ports = setup(dsn, proposal=True)
    make_skew(dsn, ports, skew)
    advance = advance_statement(True)
    gid = max(ports, key=lambda g: ports[g])
    source, target = ports[gid], min(ports.values())
    behind = (
        "(xid, message_id) <= (SELECT committed_xid, coalesce(committed_id, 0)"
        " FROM pgq.group_frontier WHERE id = %(g)s)"
    )
    with psycopg.connect(dsn, autocommit=True) as c:
        for n in range(3):
            with psycopg.connect(dsn) as p:
                publish_one(p, n)
        c.execute("UPDATE pgq.delivery SET state = 'done' WHERE group_id = %(g)s", {"g": gid})
        c.execute(*compiled(advance, {"gid": gid}))
        print(f"   group {gid} on node {source}: frontier {frontier_of(c, gid, True)}")
        shard = c.execute(
            "SELECT get_shard_id_for_distribution_column('pgq.delivery', %s)", [gid]
        ).fetchone()
        assert shard is not None
        c.execute(
            "SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
            " shard_transfer_mode => 'block_writes')",
            [shard[0], source, target],
        )
        print(f"   moved the group's shards from node {source} to node {target}")
        with psycopg.connect(dsn) as p:
            publish_one(p, 99)
        rows = c.execute(
            "SELECT message_id, xid, state FROM pgq.delivery WHERE group_id = %(g)s"
            f" AND state IN ('ready', 'leased') AND {behind}",
            {"g": gid},
        ).fetchall()
        print(f"   after one publish on node {target}: unresolved rows behind the frontier {rows}")
        c.execute(*compiled(advance, {"gid": gid}))
        print(f"   frontier after the next advance {frontier_of(c, gid, True)}")
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:9701/postgres")
    ap.add_argument("--skew", type=int, default=200, help="xids one worker is made to lead by")
    ap.add_argument(
        "--stress", type=float, default=0, help="also run concurrent publishers for S seconds"
    )
    ap.add_argument("--topics", type=int, default=1, help="topics under --stress")
    ap.add_argument(
        "--groups", type=int, default=0, help="groups per topic under --stress (0: one per worker)"
    )
    ap.add_argument(
        "--move", action="store_true", help="also move a group's shard (the proposal's caveat)"
    )
    args = ap.parse_args()
    print("== today: delivery.xid = the coordinator's xid, frontier in consumer_group (reference)")
    today = play(args.dsn, proposal=False, skew=args.skew)
    print("== proposal: delivery.xid = the shard node's xid (trigger), frontier co-located")
    proposed = play(args.dsn, proposal=True, skew=args.skew)
    print(f"== unresolved rows passed: today {today}, proposal {proposed}")
    if args.move:
        print("== proposal across a shard move (worker ahead -> worker behind)")
        moved = shard_move(args.dsn, args.skew)
        print(f"== after the move: {moved} unresolved row(s) behind the frontier")
    if args.stress:
        for proposal in (False, True):
            name = "proposal" if proposal else "today"
            print(
                f"== {name}, {args.stress:g} s of concurrent publishing (3 publishers,"
                f" {args.topics} topic(s), {args.groups or 'one per worker'} group(s) per topic)"
            )
            runs, passed, stalled = stress(
                args.dsn, proposal, args.skew, args.stress, args.topics, args.groups
            )
            print(
                f"== {name}: {runs} advances, {passed} unresolved rows passed,"
                f" {stalled} group(s) whose frontier stalled"
            )


if __name__ == "__main__":
    main()
