"""Publish and consume rates on one server and on a Citus cluster, and the plan of
each hot statement on the cluster (docs/scaling.md).

    python scripts/citus_rates.py [--single postgresql://postgres@127.0.0.1:5432/postgres]
        [--citus postgresql://postgres@127.0.0.1:9701/postgres] [--n 5000] [--rounds 3]

Each round, on each target: a fresh schema (`pgq.migrate`, distributed on the
cluster), one topic with two groups; `--n` messages published in batches of 100
(`publish_many`) and 200 one at a time (`publish`, one transaction each); then each
group drained by a `pgq.Consumer` (4 workers, `until_empty`). Rates are messages per
second of wall time, medians over the rounds; targets alternate within a round so
drift hits both. All nodes of the cluster share this machine's 2 cores with the
client: the point is that it runs and routes, not speed.

Then `EXPLAIN` on the cluster of the hot statements with a member's parameters:
each line says the statement and its Citus task count (1 = a router plan).
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

import pgq
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import breaker, claim, frontier, members, outcomes

SECOND = dt.timedelta(seconds=1)


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
                        compiled.construct_params({"gid": 1, **params}),
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
    parser.add_argument("--citus", default="postgresql://postgres@127.0.0.1:9701/postgres")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3, help="0: the plans only")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"one server": [], "Citus 3 nodes": []}
    for _ in range(args.rounds):
        results["one server"].append(one_round(args.single, False, args.n))
        results["Citus 3 nodes"].append(one_round(args.citus, True, args.n))
    if args.rounds:
        print(
            "| target | publish_many (100/batch) msgs/s | publish (1/tx) msgs/s | consume msgs/s |"
        )
        print("| --- | ---: | ---: | ---: |")
    for target, rounds in results.items() if args.rounds else ():
        cells = [
            f"{statistics.median(r[k] for r in rounds):,.0f}"
            for k in ("publish_many", "publish", "consume")
        ]
        print(f"| {target} | " + " | ".join(cells) + " |")
    print()
    for name, counts in plans(args.citus):
        print(f"- {name}: {counts}")


if __name__ == "__main__":
    main()
