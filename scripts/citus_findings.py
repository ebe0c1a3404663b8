"""Run today's hot statements (pgq/sql) on a Citus coordinator and report, per
statement, whether it runs and how Citus plans it (docs/decisions/0023-citus-placement.md).

    python scripts/citus_findings.py [--dsn postgresql://postgres@127.0.0.1:9701/postgres]
        [--message reference|topic|local|init] [--plans]

Drops and recreates the schema `pgq` on that database: point it at a throwaway
cluster only (`../shared/citus/cluster.sh start`). Each statement runs in its own
transaction with the parameters a member would send; its error (SQLSTATE and the
first line) or its `EXPLAIN (COSTS OFF)` summary (task count, the node of a router
task) is printed. Not a test: it records what today's statements do on Citus.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from typing import Any

import psycopg
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import Executable

import pgq
from pgq.sql import admin, breaker, claim, frontier, members, outcomes, publish

SECOND = dt.timedelta(seconds=1)
DIALECT = postgresql.psycopg.dialect()  # type: ignore[attr-defined]


def compiled(stmt: Executable | str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The statement's SQL with psycopg's %(name)s placeholders (schema `pgq` as
    declared) and its parameters, the statement's own literals included."""
    if isinstance(stmt, str):
        return stmt, params
    c = stmt.compile(dialect=DIALECT)
    return str(c), {**params, **c.construct_params(params)}


def distribute(conn: psycopg.Connection[Any], message: str) -> None:
    """Today's tables, placed by group; `message` as `message` says."""
    run = conn.execute
    for table in ("schema_version", "topic", "consumer_group"):
        run(f"SELECT create_reference_table('pgq.{table}')")
    run("SELECT create_distributed_table('pgq.delivery', 'group_id')")
    for table in ("member", "breaker", "breaker_history"):
        run(
            f"SELECT create_distributed_table('pgq.{table}', 'group_id',"
            " colocate_with => 'pgq.delivery')"
        )
    # audit's primary key is its own identity: kept on the coordinator for now
    run("SELECT citus_add_local_table_to_metadata('pgq.audit')")
    if message == "reference":
        run("SELECT create_reference_table('pgq.message')")
    elif message == "topic":
        run("ALTER TABLE pgq.message DROP CONSTRAINT message_pkey")
        run("ALTER TABLE pgq.message ADD PRIMARY KEY (topic_id, id)")
        run("SELECT create_distributed_table('pgq.message', 'topic_id')")
    elif message == "local":
        run("SELECT citus_add_local_table_to_metadata('pgq.message')")
    else:
        raise SystemExit(f"unknown placement {message!r}")


def summary(plan: list[str]) -> str:
    """Task count and router node of a Citus plan, or 'not distributed'."""
    counts = [re.sub(r"\s+", " ", line.strip()) for line in plan if "Task Count" in line]
    nodes = {m.group(1) for line in plan if (m := re.search(r"port=(\d+)", line))}
    if not counts:
        return "no Citus scan (runs on the coordinator)"
    return "; ".join(counts) + (f"; node port {', '.join(sorted(nodes))}" if nodes else "")


class Runner:
    def __init__(self, dsn: str, show_plans: bool) -> None:
        self.dsn = dsn
        self.show_plans = show_plans
        self.conn = psycopg.connect(dsn, autocommit=False)
        self.failures: list[str] = []

    def explain(self, sql: str, params: dict[str, Any]) -> list[str]:
        with psycopg.connect(self.dsn) as c:
            rows = c.execute("EXPLAIN (COSTS OFF) " + sql, params).fetchall()
            c.rollback()
        return [r[0] for r in rows]

    def run(self, name: str, stmt: Executable | str, params: dict[str, Any]) -> list[Any] | None:
        sql, params = compiled(stmt, params)
        try:
            cur = self.conn.execute(sql, params)
            rows = cur.fetchall() if cur.description else []
            self.conn.commit()
        except psycopg.Error as exc:
            self.conn.rollback()
            state = exc.diag.sqlstate
            first = str(exc).splitlines()[0]
            print(f"FAIL {name}: [{state}] {first}")
            if exc.diag.message_detail:
                print(f"     DETAIL: {exc.diag.message_detail}")
            self.failures.append(name)
            return None
        try:
            plan = self.explain(sql, params)
            how = summary(plan)
        except psycopg.Error as exc:
            plan, how = [], f"EXPLAIN failed: {str(exc).splitlines()[0]}"
        print(f"ok   {name}: {how}; {len(rows)} row(s)")
        if self.show_plans:
            for line in plan[:12]:
                print(f"       {line}")
        return rows

    def sequence(self, name: str, steps: list[tuple[Executable | str, dict[str, Any]]]) -> None:
        """Statements that must share one transaction (as the store runs them)."""
        try:
            for stmt, params in steps:
                self.conn.execute(*compiled(stmt, params))
            self.conn.commit()
            print(f"ok   {name} (one transaction, {len(steps)} statements)")
        except psycopg.Error as exc:
            self.conn.rollback()
            print(f"FAIL {name}: [{exc.diag.sqlstate}] {str(exc).splitlines()[0]}")
            self.failures.append(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:9701/postgres")
    ap.add_argument(
        "--message",
        default="reference",
        choices=["reference", "topic", "local", "init"],
        help="where `message` goes; init: the whole placement of `pgq init --distributed`",
    )
    ap.add_argument("--plans", action="store_true", help="print the first lines of each plan")
    args = ap.parse_args()

    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA IF EXISTS pgq CASCADE")
    engine = pgq.connect(args.dsn, schema="pgq", pool_size=None)
    pgq.migrate(engine, distributed=args.message == "init")
    engine.dispose()
    with psycopg.connect(args.dsn, autocommit=True) as c:
        if args.message != "init":
            distribute(c, args.message)
        print(f"== placement: message {args.message}")
        for row in c.execute(
            "SELECT logicalrelid::text, partmethod,"
            " column_to_column_name(logicalrelid, partkey), colocationid"
            " FROM pg_dist_partition WHERE logicalrelid::text LIKE 'pgq.%' ORDER BY 1"
        ):
            print("    ", row)

    r = Runner(args.dsn, args.plans)
    ttl = 10 * SECOND
    member = "m1"
    print("== setup (topic, groups: subscribe's statements)")
    r.run("create_topic", publish.create_topic(), {"name": "t1"})
    tid = 1
    for gid, name in ((1, "g1"), (2, "g2")):
        r.sequence(
            f"subscribe {name} (lock topic, insert group, insert breaker, backfill)",
            [
                (publish.lock_topic_for_subscribe(), {"name": "t1"}),
                (publish.insert_group(), {"name": name, "topic_id": tid}),
                (publish.insert_breaker(), {"gid": gid}),
                (publish.backfill_group(), {"gid": gid, "topic_id": tid}),
            ],
        )
    print("== publish")
    pub = {
        "topic": "t1",
        "payloads": json.dumps([{"n": i} for i in range(20)]),
        "key": None,
        "headers": None,
        "delay": 0 * SECOND,
        "channel": "pgq.pgq",
    }
    r.run("lock_topic_for_publish", publish.lock_topic_for_publish(), {"topic": "t1"})
    r.run("publish_batch", publish.publish_batch(), pub)
    r.sequence(
        "publish (lock topic + publish_batch)",
        [(publish.lock_topic_for_publish(), {"topic": "t1"}), (publish.publish_batch(), pub)],
    )
    have = r.run("messages present", "SELECT count(*) FROM pgq.message", {})
    rows = r.run("delivery rows present", "SELECT count(*) FROM pgq.delivery", {})
    if have and rows and rows[0][0] == 0:
        print("     (seeding delivery rows by hand, as publish_batch would)")
        r.run(
            "seed delivery",
            "INSERT INTO pgq.delivery (group_id, message_id, xid) "
            "SELECT g, m.id, m.xid FROM pgq.message m, (VALUES (1), (2)) v(g)",
            {},
        )
    if have and have[0][0] == 0:
        print("     (seeding messages and delivery rows by hand)")
        r.run(
            "seed message",
            "INSERT INTO pgq.message (topic_id, payload) "
            "SELECT 1, jsonb_build_object('n', i) FROM generate_series(1, 20) i",
            {},
        )
        r.run(
            "seed delivery",
            "INSERT INTO pgq.delivery (group_id, message_id, xid) "
            "SELECT g, m.id, m.xid FROM pgq.message m, (VALUES (1), (2)) v(g)",
            {},
        )

    print("== members")
    joining = {"gid": 1, "member": member, "host": "h", "pid": 1, "takeover": True, "ttl": ttl}
    r.run("members.join_new", members.join_new(), joining)
    joined = r.run("members.join_existing", members.join_existing(), joining)  # the takeover
    started = joined[0][0] if joined else None
    if started is None:
        r.run(
            "seed member",
            "INSERT INTO pgq.member (group_id, name, host, pid) VALUES (1, 'm1', 'h', 1)",
            {},
        )
        started = r.run(
            "read started_at", "SELECT started_at FROM pgq.member WHERE group_id = 1", {}
        )[0][0]  # type: ignore[index]
    r.run(
        "members.take_session_lock",
        members.take_session_lock(),
        {"table": "pgq.member", "gid": 1, "member": member},
    )
    r.run(
        "members.heartbeat",
        members.heartbeat(),
        {"gid": 1, "member": member, "started": started, "local": "closed", "tripped_epoch": None},
    )
    holders = r.run(
        "members.holding (liveness, on the coordinator)",
        members.holding(""),
        {"gids": [1], "names": [member], "table": "pgq.member"},
    )
    present = {
        "present_gids": [row[0] for row in holders or []],
        "present_names": [row[1] for row in holders or []],
    }
    r.run(
        "members.drain_state",
        members.drain_state(),
        {"gid": 1, "member": member, "wait": 0 * SECOND, "ttl": ttl, **present},
    )
    r.run(
        "members.forget_departed",
        members.forget_departed(),
        {"gid": 1, "after": 3600 * SECOND, **present},
    )

    print("== claim path")
    leased = r.run(
        "claim.claim(10, bodies=False)",
        claim.claim(10, bodies=False),
        {"gid": 1, "member": member, "lease": 30 * SECOND, "token": -(1 << 20)},
    )
    r.run("claim.message_bodies", claim.message_bodies(), {"topic_id": 1, "ids": [1, 2]})
    if not leased:
        print("     (leasing rows by hand, with tokens from the sequence on the coordinator)")
        leased = r.run(
            "seed lease",
            "UPDATE pgq.delivery SET state = 'leased', lease_owner = 'm1', "
            "lease_seq = 1000 + message_id, lease_expires_at = now() + interval '30 s' "
            "WHERE group_id = 1 AND message_id <= 10 RETURNING message_id, lease_seq, attempts",
            {},
        )
    ids = [row[0] for row in leased or []]
    seqs = [row[1] for row in leased or []]
    fence = {"gid": 1, "member": member, "ids": ids, "seqs": seqs}
    r.run("claim.extend_leases", claim.extend_leases(), {**fence, "lease": 30 * SECOND})
    r.run("outcomes.ack_done", outcomes.ack_done(), {**fence, "ids": ids[:5], "seqs": seqs[:5]})
    n = len(ids[5:8])
    r.run(
        "outcomes.record_failures",
        outcomes.record_failures(),
        {
            **fence,
            "ids": ids[5:8],
            "seqs": seqs[5:8],
            "states": ["ready"] * n,
            "charges": [1] * n,
            "delays": [0.0] * n,
            "classes": ["systemic"] * n,
            "errors": ["boom"] * n,
            "epochs": [0] * n,
        },
    )
    r.run("outcomes.settled", outcomes.settled(), fence)
    r.run("claim.release", claim.release(), {**fence, "ids": ids[8:9], "seqs": seqs[8:9]})
    r.run(
        "expire one lease (by hand)",
        "UPDATE pgq.delivery SET lease_expires_at = now() - interval '1 s' "
        "WHERE group_id = 1 AND state = 'leased'",
        {},
    )
    r.run("claim.sweep_expired", claim.sweep_expired(), {"gid": 1, "limit": 100, "max_reclaims": 3})
    r.run("claim.add_to_total", claim.add_to_total("released_total"), {"gid": 1, "n": 1})

    print("== frontier, pruning, retention")
    r.sequence(
        "frontier.advance_frontier (after without_jit)",
        [(frontier.without_jit(), {}), (frontier.advance_frontier(), {"gid": 1})],
    )
    r.run("frontier.advance_frontier", frontier.advance_frontier(), {"gid": 1})
    r.run("frontier.prune_behind", frontier.prune_behind(), {"gid": 1})
    r.run(
        "frontier.lock_topic_for_retention", frontier.lock_topic_for_retention(), {"topic_id": tid}
    )
    r.run(
        "frontier.delete_expired_messages",
        frontier.delete_expired_messages(),
        {"topic_id": tid, "retention": 0 * SECOND, "limit": 100},
    )
    r.sequence(
        "retention (lock topic + delete)",
        [
            (frontier.lock_topic_for_retention(), {"topic_id": tid}),
            (
                frontier.delete_expired_messages(),
                {"topic_id": tid, "retention": 0 * SECOND, "limit": 100},
            ),
        ],
    )

    print("== breaker")
    r.run("breaker.state", breaker.state(), {"gid": 1})
    r.run(
        "members.heartbeat (tripped)",
        members.heartbeat(),
        {"gid": 1, "member": member, "started": started, "local": "open", "tripped_epoch": 0},
    )
    r.run(
        "breaker.open_on_quorum",
        breaker.open_on_quorum(),
        {
            **{"gid": 1, "at_epoch": 0, "min_members": 1, "quorum": 0.5},
            **{"ttl": ttl, "member": member, **present},
        },
    )
    epoch_rows = r.run("breaker.state (after open)", breaker.state(), {"gid": 1})
    epoch = epoch_rows[0][1] if epoch_rows else 0
    if epoch == 0:
        print("     (opening the breaker by hand)")
        r.run(
            "open by hand",
            "UPDATE pgq.breaker SET state = 'OPEN', epoch = 1 WHERE group_id = 1",
            {},
        )
        epoch = 1
    at = {"gid": 1, "at_epoch": epoch}
    r.run("breaker.set_prober", breaker.set_prober(), {"gid": 1, "member": member})
    r.run(
        "breaker.mark_prober",
        breaker.mark_prober(),
        {"gid": 1, "member": member, "table": "pgq.member"},
    )
    r.run(
        "members.holding (the prober, for status)",
        members.holding("prober"),
        {"gids": [1], "names": [member], "table": "pgq.member"},
    )
    r.run("breaker.probe_slot", breaker.probe_slot(), at)
    r.run("breaker.reserve_probe", breaker.reserve_probe(), {**at, "hold": 30 * SECOND})
    probe = None
    for kind in breaker.PROBE_KINDS:
        got = r.run(
            f"breaker.claim_probe({kind}, False, bodies=False)",
            breaker.claim_probe(kind, False, bodies=False),
            {**at, "member": member, "lease": 30 * SECOND, "max_refunds": 3, "token": -(2 << 20)},
        )
        probe = probe or (got[0] if got else None)
    logged = {"member": member, "probe_id": probe[0] if probe else 1}
    r.run("breaker.probe_failed", breaker.probe_failed(), {**at, **logged, "delay": 5 * SECOND})
    r.run("breaker.probe_again", breaker.probe_again(), {**at, "delay": 0 * SECOND})
    if probe is not None:
        lease = {"gid": 1, "id": probe[0], "seq": probe[1], "member": member}
        r.run("breaker.probe_charges", breaker.probe_charges(), lease)
        r.run("breaker.probe_done", breaker.probe_done(), {**lease, "refunded": 1})
    r.run("breaker.close", breaker.close(), {**at, **logged, "refunded": 0})
    r.run(
        "charge two rows by hand (as record_failures would have)",
        "UPDATE pgq.delivery SET state = 'dead', error_class = 'systemic', error_epoch = 0,"
        " refundable_attempts = 1, lease_owner = NULL WHERE group_id = 1 AND message_id IN"
        " (SELECT message_id FROM pgq.delivery WHERE group_id = 1 AND state <> 'done'"
        " ORDER BY message_id DESC LIMIT 2)",
        {},
    )
    refund = {"gid": 1, "from_epoch": 0, "close_epoch": epoch + 1, "max_refunds": 3}
    r.run("breaker.reconcile_batch", breaker.reconcile_batch(), {**refund, "limit": 100})
    r.run("breaker.reconcile_done", breaker.reconcile_done(), refund)
    r.run("breaker.lock_held", breaker.lock_held(), {})

    print("== admin (pgq check, requeue, purge, show, audit)")
    r.run("admin.check_group", admin.check_group(), {"gid": 1})
    pending = {"gid": 1, "pending_from": None, "pending_to": None, "max_refunds": 3}
    r.run("admin.check_dead", admin.check_dead(), pending)
    r.run(
        "kill two rows by hand",
        "UPDATE pgq.delivery SET state = 'dead', error_class = 'message', lease_owner = NULL"
        " WHERE group_id = 1 AND message_id IN (SELECT message_id FROM pgq.delivery"
        " WHERE group_id = 1 AND state = 'ready' ORDER BY message_id LIMIT 2)",
        {},
    )
    dead = r.run(
        "dead ids", "SELECT message_id FROM pgq.delivery WHERE group_id = 1 AND state = 'dead'", {}
    )
    audited = {"gid": 1, "reason": "test", "actor": "me", "max_listed": 100}
    r.run(
        "admin.requeue_ids",
        admin.requeue_ids(),
        {**audited, "ids": [row[0] for row in dead or []][:1]},
    )
    r.run("admin.purge_dead", admin.purge_dead(), {**audited, **pending})
    r.run("admin.audit_trail", admin.audit_trail(), {"gid": 1, "limit": 10})
    r.run(
        "admin.message_in_group",
        admin.message_in_group(),
        {"gid": 1, "mid": 1, "message_xid": None},
    )
    r.run("members.leave", members.leave(), {"gid": 1, "member": member, "started": started})

    print("== the replicas of the reference table consumer_group (must agree)")
    for row in r.conn.execute(
        "SELECT nodeport, result FROM run_command_on_placements('pgq.consumer_group',"
        " $$SELECT md5(string_agg(g::text, ',' ORDER BY id)) FROM %s g$$) ORDER BY nodeport"
    ):
        print(f"     node {row[0]}: {row[1]}")
    r.conn.rollback()
    print(f"== {len(r.failures)} failed: {', '.join(r.failures)}")


if __name__ == "__main__":
    main()
