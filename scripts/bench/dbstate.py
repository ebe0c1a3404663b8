"""What the database holds, read with plain SQL: the bench's independent witness.

The exactly-once check does not trust pgq's code to count its own work: it
counts the group's delivery rows by state itself (plus the frontier's pruned
count), then asks `pgq.status` the same question through the public API. Table
sizes, dead tuples and storage parameters come from PostgreSQL's catalogues.
None of this imports pgq's internals; it reads the documented tables.
"""

from __future__ import annotations

from typing import Any

import psycopg

import pgq
from scripts.bench.common import GROUP, SCHEMA

_TABLES = "relname IN ('delivery', 'message')"


def db_counts(dsn: str, schema: str = SCHEMA, group: str = GROUP) -> dict[str, int]:
    """Delivery rows of the group by state plus the frontier's pruned done count,
    and the same seen through `pgq.status` (`pgq status GROUP --json`)."""
    with psycopg.connect(dsn) as c:
        gid, pruned = c.execute(
            f"SELECT g.id, s.done_pruned FROM {schema}.consumer_group g"
            f" JOIN {schema}.group_state s ON s.group_id = g.id WHERE g.name = %s",
            (group,),
        ).fetchone()
        done, done_distinct, ready, leased, dead = c.execute(
            f"SELECT count(*) FILTER (WHERE state = 'done'),"
            f" count(DISTINCT message_id) FILTER (WHERE state = 'done'),"
            f" count(*) FILTER (WHERE state = 'ready'),"
            f" count(*) FILTER (WHERE state = 'leased'),"
            f" count(*) FILTER (WHERE state = 'dead')"
            f" FROM {schema}.delivery WHERE group_id = %s",
            (gid,),
        ).fetchone()
        messages = c.execute(f"SELECT count(*) FROM {schema}.message").fetchone()[0]
    engine = pgq.connect(dsn, schema=schema, pool_size=None)
    try:
        st = pgq.status(engine, group)
    finally:
        engine.dispose()
    # pruned rows were done rows of distinct ids (primary key (group_id, message_id))
    return {
        "db_done": done + pruned,
        "db_done_distinct": done_distinct + pruned,
        "db_done_pruned": pruned,
        "db_ready": ready,
        "db_leased": leased,
        "db_dead": dead,
        "db_left": ready + leased,
        "db_messages": messages,
        "status_done": st["counts"]["done"],
        "status_lag": st["lag"],
        "status_dead": st["counts"]["dead"],
        "status_committed": st["committed"],
        "status_members_live": sum(1 for m in st["members"] if m["live"]),
    }


def unresolved(dsn: str, schema: str = SCHEMA) -> int:
    """Delivery rows still ready or leased (an outcome not yet written)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return int(
            c.execute(
                f"SELECT count(*) FROM {schema}.delivery WHERE state IN ('ready', 'leased')"
            ).fetchone()[0]
        )


def xacts(dsn: str) -> int:
    """Transactions the server has finished in this database so far."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return int(
            c.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database"
                " WHERE datname = current_database()"
            ).fetchone()[0]
        )


def sizes(dsn: str, schema: str = SCHEMA) -> dict[str, Any]:
    """Sizes, row counts, dead tuples and autovacuum runs of `delivery` and `message`."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            f"SELECT pg_total_relation_size('{schema}.delivery'),"
            f" pg_relation_size('{schema}.delivery'),"
            f" pg_indexes_size('{schema}.delivery'), pg_total_relation_size('{schema}.message'),"
            f" (SELECT count(*) FROM {schema}.delivery), (SELECT count(*) FROM {schema}.message)"
        ).fetchone()
        dead = dict(
            c.execute(
                "SELECT relname, n_dead_tup FROM pg_stat_user_tables"
                f" WHERE schemaname = %s AND {_TABLES}",
                (schema,),
            ).fetchall()
        )
        vac = dict(
            c.execute(
                "SELECT relname, autovacuum_count FROM pg_stat_user_tables"
                f" WHERE schemaname = %s AND {_TABLES}",
                (schema,),
            ).fetchall()
        )
    return {
        "delivery_total_mb": row[0] / 2**20,
        "delivery_heap_mb": row[1] / 2**20,
        "delivery_indexes_mb": row[2] / 2**20,
        "message_total_mb": row[3] / 2**20,
        "delivery_rows": row[4],
        "message_rows": row[5],
        "delivery_dead_tup": dead.get("delivery"),
        "delivery_autovacuums": vac.get("delivery"),
        "message_dead_tup": dead.get("message"),
        "message_autovacuums": vac.get("message"),
    }


def reloptions(dsn: str, schema: str = SCHEMA) -> dict[str, Any]:
    """Storage parameters (fillfactor, autovacuum_*) pgq set on its big tables."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT c.relname, c.reloptions FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname IN ('delivery', 'message')",
            (schema,),
        ).fetchall()
        server = {
            k: c.execute(f"SHOW {k}").fetchone()[0]
            for k in (
                "autovacuum_naptime",
                "autovacuum_vacuum_cost_limit",
                "autovacuum_max_workers",
            )
        }
    return {"tables": {r[0]: r[1] for r in rows}, "server": server}


def analyze(dsn: str) -> None:
    """ANALYZE the whole database (untimed, between publishing and consuming)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ANALYZE")
