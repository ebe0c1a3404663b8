"""What the placement of `message` costs on Citus: publishing and claim-side message
reads, with `message` a reference table or distributed by topic
(docs/decisions/0023-citus-placement.md, section 4).

    python scripts/citus_message_bench.py [--dsn ...] [--n 300]

Drops and recreates the schema `pgq` (throwaway clusters only). One client, one
topic with two groups (one per worker where the hash allows). Publishing is
`pgq.publish_many` of one message, committed each time; the claim-side read is
the body lookup of 100 claimed ids, as a join on the group's node (reference) or
as its own statement on the topic's shard (by topic). Medians; a 2-core machine
shared with the cluster: the order matters, not the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from citus_findings import distribute

import pgq


def run(dsn: str, placement: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA IF EXISTS pgq CASCADE")
    engine = pgq.connect(dsn, schema="pgq", pool_size=2)
    pgq.migrate(engine)
    with psycopg.connect(dsn, autocommit=True) as c:
        distribute(c, placement)
    pgq.create_topic(engine, "t")
    for g in ("g1", "g2"):
        pgq.subscribe(engine, g, "t")
    pgq.publish_many(engine, "t", [{"warm": i} for i in range(200)])
    times = []
    for i in range(n):
        start = time.perf_counter()
        pgq.publish(engine, "t", {"n": i})
        times.append(time.perf_counter() - start)
    publish_ms = statistics.median(times) * 1000
    with psycopg.connect(dsn, autocommit=True) as c:
        ids = [
            r[0]
            for r in c.execute(
                "SELECT message_id FROM pgq.delivery WHERE group_id = 1 ORDER BY 1 LIMIT 100"
            )
        ]
        join = (
            "SELECT d.message_id, m.payload::text FROM pgq.delivery d"
            " JOIN LATERAL (SELECT payload FROM pgq.message WHERE id = d.message_id OFFSET 0) m"
            " ON true"
            " WHERE d.group_id = 1 AND d.message_id = ANY(%s)"
        )
        apart = "SELECT id, payload::text FROM pgq.message WHERE topic_id = 1 AND id = ANY(%s)"
        sql = join if placement == "reference" else apart
        reads = []
        for _ in range(n):
            start = time.perf_counter()
            c.execute(sql, [ids]).fetchall()
            reads.append(time.perf_counter() - start)
        copies = c.execute(
            "SELECT count(*) FROM pg_dist_shard_placement p JOIN pg_dist_shard s USING (shardid)"
            " WHERE s.logicalrelid = 'pgq.message'::regclass"
        ).fetchone()
    engine.dispose()
    print(
        f"message {placement}: publish (1 message, 2 groups) median {publish_ms:.2f} ms;"
        f" read 100 bodies median {statistics.median(reads) * 1000:.2f} ms"
        f" ({'joined on the group node' if placement == 'reference' else 'own statement'});"
        f" message placements {copies[0] if copies else '?'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:9701/postgres")
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    for placement in ("reference", "topic", "reference", "topic"):
        run(args.dsn, placement, args.n)


if __name__ == "__main__":
    main()
