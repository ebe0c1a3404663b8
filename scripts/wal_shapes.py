"""WAL and statement time per message for candidate shapes of `delivery` (decision 0037).

Each shape is a scratch copy of `delivery`'s columns with its own indexes, claim and
ack; N ready rows are claimed 100 at a time and acked, on one connection, and the
WAL written between the first claim and the last ack is divided by N. The floor of
`../shared/bench` (three narrow columns, two non-HOT updates) runs last for scale.

    .venv/bin/python scripts/wal_shapes.py --dsn postgresql://postgres@127.0.0.1/postgres

The scratch schema `pgq_wal_shapes` is dropped at the end.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import psycopg

SCHEMA = "pgq_wal_shapes"
BATCH = 100

TABLE = """
CREATE TABLE d (
  group_id int NOT NULL, message_id bigint NOT NULL,
  xid xid8 NOT NULL DEFAULT pg_current_xact_id(), state text NOT NULL DEFAULT 'ready',
  available_at timestamptz NOT NULL DEFAULT now(), attempts int NOT NULL DEFAULT 0,
  reclaims int NOT NULL DEFAULT 0, refundable_attempts int NOT NULL DEFAULT 0,
  refundable_reclaims int NOT NULL DEFAULT 0, refunds int NOT NULL DEFAULT 0,
  lease_owner text, lease_seq bigint NOT NULL DEFAULT 0, lease_expires_at timestamptz,
  error_class text, last_error text, error_epoch int,
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (group_id, message_id)
) WITH (fillfactor = 80)
"""

READY_IDX = "CREATE INDEX ON d (group_id, available_at, message_id) WHERE state = 'ready'"
LEASED_IDX = "CREATE INDEX ON d (group_id, lease_expires_at) WHERE state = 'leased'"
FRONTIER_IDX = "CREATE INDEX ON d (group_id, xid, message_id)"
FAILED_IDX = "CREATE INDEX ON d (group_id, error_class) WHERE error_class IS NOT NULL"
CHARGED_IDX = (
    "CREATE INDEX ON d (group_id, error_epoch) WHERE refundable_attempts + refundable_reclaims > 0"
)
PENDING_IDX = (
    "CREATE INDEX ON d (group_id, available_at, message_id) WHERE state IN ('ready', 'leased')"
)


@dataclass(frozen=True)
class Shape:
    name: str
    indexes: tuple[str, ...]
    lease: str
    order: str
    ack: str
    prune: str | None = None


LEASE = (
    "state = 'leased', lease_owner = 'm', lease_seq = %(token)s,"
    " lease_expires_at = now() + interval '30 s', updated_at = now()"
)
DELETE_ACK = "DELETE FROM d WHERE group_id = 1 AND message_id = ANY(%(ids)s)"
TODAY = Shape(
    "A: today (ack marks done, prune deletes)",
    (READY_IDX, LEASED_IDX, FRONTIER_IDX, FAILED_IDX, CHARGED_IDX),
    LEASE,
    "available_at <= now() ORDER BY available_at, message_id",
    "UPDATE d SET state = 'done', attempts = attempts + 1, lease_owner = NULL,"
    " lease_expires_at = NULL, updated_at = now()"
    " WHERE group_id = 1 AND message_id = ANY(%(ids)s)",
    "DELETE FROM d WHERE group_id = 1 AND state = 'done'",
)
DELETES = replace(TODAY, name="B: the ack deletes", ack=DELETE_ACK, prune=None)
SHAPES = (
    TODAY,
    DELETES,
    replace(
        DELETES,
        name="C: B without the frontier index",
        indexes=TODAY.indexes[:2] + TODAY.indexes[3:],
    ),
    replace(
        DELETES,
        name="D: C, one pending index (lease expiry in available_at)",
        indexes=(PENDING_IDX, FAILED_IDX, CHARGED_IDX),
        lease=LEASE + ", available_at = now() + interval '30 s'",
    ),
    replace(
        DELETES,
        name="E: B, no index on a claimed column (claim in id order)",
        indexes=(FAILED_IDX, CHARGED_IDX),
        order="available_at <= now() ORDER BY message_id",
    ),
)


def _lsn(conn: psycopg.Connection) -> str:
    return conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]


def _wal_since(conn: psycopg.Connection, lsn: str) -> float:
    return float(
        conn.execute("SELECT pg_current_wal_insert_lsn() - %s::pg_lsn", (lsn,)).fetchone()[0]
    )


def _updates(conn: psycopg.Connection, table: str) -> tuple[int, int]:
    conn.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(0.6)  # the statistics collector's flush interval is 0.5 s at most
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
        (table,),
    ).fetchone()
    return int(row[0]), int(row[1])


def run_shape(conn: psycopg.Connection, shape: Shape, n: int) -> str:
    conn.execute("CREATE SCHEMA " + SCHEMA)
    conn.execute("SET search_path = " + SCHEMA)
    conn.execute(TABLE)
    for index in shape.indexes:
        conn.execute(index)
    conn.execute(
        "INSERT INTO d (group_id, message_id) SELECT 1, g FROM generate_series(1, %s) g", (n,)
    )
    conn.execute("VACUUM ANALYZE d")
    before = _updates(conn, "d")
    claim = (
        f"UPDATE d SET {shape.lease} WHERE group_id = 1 AND message_id IN ("
        f"SELECT message_id FROM d WHERE group_id = 1 AND state = 'ready' AND {shape.order}"
        f" LIMIT {BATCH} FOR UPDATE SKIP LOCKED) RETURNING message_id"
    )
    start, claiming, acking, token = _lsn(conn), 0.0, 0.0, 0
    while True:
        token += 1
        t0 = time.perf_counter()
        ids = [r[0] for r in conn.execute(claim, {"token": token}).fetchall()]
        t1 = time.perf_counter()
        claiming += t1 - t0
        if not ids:
            break
        conn.execute(shape.ack, {"ids": ids})
        acking += time.perf_counter() - t1
    if shape.prune:
        t0 = time.perf_counter()
        conn.execute(shape.prune)
        acking += time.perf_counter() - t0
    wal = _wal_since(conn, start)
    after = _updates(conn, "d")
    conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
    updates, hot = after[0] - before[0], after[1] - before[1]
    return (
        f"| {shape.name} | {wal / n:.0f} | {claiming / n * 1e6:.1f} + {acking / n * 1e6:.1f}"
        f" | {updates / n:.2f} ({hot / n:.2f}) |"
    )


def run_floor(conn: psycopg.Connection, n: int) -> str:
    conn.execute("CREATE SCHEMA " + SCHEMA)
    conn.execute("SET search_path = " + SCHEMA)
    conn.execute(
        "CREATE TABLE jobs (id bigserial PRIMARY KEY,"
        " status smallint NOT NULL DEFAULT 0, payload jsonb)"
    )
    conn.execute("CREATE INDEX ON jobs (id) WHERE status = 0")
    conn.execute(
        "INSERT INTO jobs (payload)"
        " SELECT jsonb_build_object('n', g) FROM generate_series(1, %s) g",
        (n,),
    )
    conn.execute("VACUUM ANALYZE jobs")
    start, t0 = _lsn(conn), time.perf_counter()
    while True:
        rows = conn.execute(
            "UPDATE jobs SET status = 1 WHERE id IN (SELECT id FROM jobs WHERE status = 0"
            f" ORDER BY id LIMIT {BATCH} FOR UPDATE SKIP LOCKED) RETURNING id, payload"
        ).fetchall()
        if not rows:
            break
        conn.execute("UPDATE jobs SET status = 2 WHERE id = ANY(%s)", ([r[0] for r in rows],))
    wal, took = _wal_since(conn, start), time.perf_counter() - t0
    conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
    return (
        f"| the bench's floor | {wal / n:.0f} | {took / n * 1e6:.1f} (claim and ack) | 2.00 (0) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        print("| shape | WAL B/msg | claim + ack µs/msg | updates (HOT) per msg |")
        print("|---|---:|---:|---:|")
        for shape in SHAPES:
            print(run_shape(conn, shape, args.n), flush=True)
        print(run_floor(conn, args.n))


if __name__ == "__main__":
    main()
