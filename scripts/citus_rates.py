"""Publish and consume rates on one server and on a Citus cluster, and the plan of
each hot statement on the cluster (docs/scaling.md).

    python scripts/citus_rates.py [--single postgresql://postgres@127.0.0.1:5432/postgres]
        [--citus postgresql://postgres@127.0.0.1:9701/postgres [--citus DSN ...]]
        [--n 5000] [--rounds 3]

Each round, on each target: a fresh schema (`pgq.migrate`, distributed on the
cluster), one topic with two groups; `--n` messages published in batches of 100
(`publish_many`) and 200 one at a time (`publish`, one transaction each); then each
group drained by a `pgq.Consumer` (4 workers, `until_empty`). Rates are messages per
second of wall time, medians over the rounds; targets alternate within a round so
drift hits both. All nodes of the cluster share this machine's 2 cores with the
client: the point is that it runs and routes, not speed.

`--citus` may be given more than once (a cluster of 2 workers and one of 3, say):
each is labelled with its number of workers. Every connection to a cluster runs
with `citus.multi_task_query_log_level = warning`, and each warning Citus sends
(a statement about to run as several tasks) is counted: the table's last column,
0 when every statement of the run was routed to one node.

Then `EXPLAIN` on the (first) cluster of the hot statements with a member's
parameters: each line says the statement and its Citus task count (1 = a router plan).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sqlalchemy import Engine, event

import pgq
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import breaker, claim, frontier, members, outcomes

SECOND = dt.timedelta(seconds=1)


MULTI_TASK = "multi-task query about to be executed"
"""What Citus says at `citus.multi_task_query_log_level` before a multi-task statement."""

multi_task = 0
"""Multi-task statements seen on this process's connections (all of them, the
consumers' too: the handler is added to every connection any engine opens)."""


@event.listens_for(Engine, "connect")
def _count_multi_task(dbapi_connection: Any, _: Any) -> None:
    def seen(diagnostic: Any) -> None:
        global multi_task
        if MULTI_TASK in (diagnostic.message_primary or ""):
            multi_task += 1

    dbapi_connection.add_notice_handler(seen)


def watched(dsn: str) -> str:
    """`dsn` with Citus warning before each multi-task statement (libpq `options`)."""
    return make_conninfo(dsn, options="-c citus.multi_task_query_log_level=warning")


def workers(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_catalog.citus_get_active_worker_nodes()")
        return int(row.fetchone()[0])  # type: ignore[index]


def fresh(dsn: str, schema: str, distributed: bool) -> Any:
    drop(dsn, schema)
    engine = pgq.connect(dsn, schema=schema, pool_size=4)
    pgq.migrate(engine, distributed=distributed)
    pgq.create_topic(engine, "t")
    for group in ("g1", "g2"):
        pgq.subscribe(engine, group, "t")
    return engine


def drop(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def one_round(dsn: str, distributed: bool, n: int) -> dict[str, float]:
    schema = f"pgq_rates_{os.getpid()}"
    engine = fresh(dsn, schema, distributed)
    try:
        start = time.perf_counter()
        for first in range(0, n, 100):
            pgq.publish_many(engine, "t", [{"n": i} for i in range(first, min(first + 100, n))])
        batched = n / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(200):
            pgq.publish(engine, "t", {"single": i})
        single = 200 / (time.perf_counter() - start)
        consumed = {}
        for group in ("g1", "g2"):
            seen: set[int] = set()
            consumer = pgq.Consumer(engine, group, lambda m, seen=seen: seen.add(m.id), workers=4)
            start = time.perf_counter()
            summary = consumer.run(until_empty=True, max_runtime=600)
            consumed[group] = (n + 200) / (time.perf_counter() - start)
            assert summary.done == n + 200 == len(seen), (group, summary, len(seen))
        return {
            "publish_many": batched,
            "publish": single,
            "consume": statistics.mean(consumed.values()),
        }
    finally:
        engine.dispose()
        drop(dsn, schema)


def plans(dsn: str) -> list[tuple[str, str]]:
    """(statement, task counts) of each hot statement on the cluster."""
    schema = f"pgq_plans_{os.getpid()}"
    engine = fresh(dsn, schema, True)
    pgq.publish_many(engine, "t", [{"n": i} for i in range(10)])
    member = {"member": "m1", "lease": 30 * SECOND}
    fence = {**member, "ids": [1, 2], "seqs": [-(1 << 20), -(1 << 20)]}
    present = {"present_gids": [1], "present_names": ["m1"]}
    statements: list[tuple[str, Any, dict[str, Any]]] = [
        ("claim (leases)", claim.claim(100, bodies=False), {**member, "token": -(1 << 20)}),
        ("claim (messages)", claim.message_bodies(), {"topic_id": 1, "ids": [1, 2]}),
        ("ack", outcomes.ack_done(), fence),
        (
            "failure",
            outcomes.record_failures(),
            {
                **fence,
                **{"states": ["ready", "dead"], "charges": [1, 1], "delays": [1.0, 0.0]},
                **{"classes": ["systemic", "message"], "errors": ["x", "y"], "epochs": [0, 0]},
                **{"seconds": [0.1, 0.2]},
            },
        ),
        ("lease extension", claim.extend_leases(), fence),
        (
            "heartbeat",
            members.heartbeat(),
            {"member": "m1", "started": dt.datetime.now(dt.timezone.utc), "local": "closed"}
            | {"tripped_epoch": None},
        ),
        ("sweep", claim.sweep_expired(), {"limit": 100, "max_reclaims": 3}),
        (
            "drain check",
            members.drain_state(),
            {**member, "ttl": 30 * SECOND, "wait": SECOND} | present,
        ),
        ("frontier advance", frontier.advance_frontier(), {}),
        ("breaker state", breaker.state(), {}),
        (
            "reconciliation batch",
            breaker.reconcile_batch(),
            {"limit": 100, "from_epoch": 0, "close_epoch": 2, "max_refunds": 3},
        ),
        (
            "reconciliation done",
            breaker.reconcile_done(),
            {"from_epoch": 0, "close_epoch": 2, "max_refunds": 3},
        ),
    ]
    found = []
    try:
        with engine.connect() as conn:
            for name, stmt, params in statements:
                compiled = stmt.compile(
                    dialect=conn.dialect,
                    schema_translate_map={SCHEMA_PLACEHOLDER: schema},
                    render_schema_translate=True,
                )
                lines = [
                    row[0]
                    for row in conn.exec_driver_sql(
                        "EXPLAIN (COSTS OFF) " + str(compiled),
                        compiled.construct_params({"gid": 1, "member": "m1", **params}),
                    )
                ]
                counts = [line.split(":")[1].strip() for line in lines if "Task Count" in line]
                subplans = sum("Distributed Subplan" in line for line in lines)
                found.append((name, f"tasks {'/'.join(counts)}, subplans {subplans}"))
                conn.rollback()
    finally:
        engine.dispose()
        drop(dsn, schema)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--single", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--citus", action="append", help="a coordinator (repeatable)")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3, help="0: the plans only")
    args = parser.parse_args()
    clusters = args.citus or ["postgresql://postgres@127.0.0.1:9701/postgres"]
    targets = {"one server": (args.single, False)}
    for dsn in clusters:
        targets[f"Citus, coordinator + {workers(dsn)} workers"] = (watched(dsn), True)
    results: dict[str, list[dict[str, float]]] = {target: [] for target in targets}
    for _ in range(args.rounds):
        for target, (dsn, distributed) in targets.items():
            before = multi_task
            results[target].append(one_round(dsn, distributed, args.n))
            results[target][-1]["multi_task"] = multi_task - before
    if args.rounds:
        print(
            "| target | publish_many (100/batch) msgs/s | publish (1/tx) msgs/s | consume msgs/s"
            " | multi-task statements |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
    for target, rounds in results.items() if args.rounds else ():
        cells = [
            f"{statistics.median(r[k] for r in rounds):,.0f}"
            for k in ("publish_many", "publish", "consume")
        ]
        if targets[target][1]:
            cells.append(f"{sum(r['multi_task'] for r in rounds):,.0f}")
        else:
            cells.append("")
        print(f"| {target} | " + " | ".join(cells) + " |")
    print()
    for name, counts in plans(clusters[0]):
        print(f"- {name}: {counts}")


if __name__ == "__main__":
    main()
