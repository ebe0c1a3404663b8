"""Planner statistics of the delivery table: are they stale, and refresh them.

The claim and outcome statements run as prepared statements whose plans are
only as good as the table's statistics. A burst onto a new table (or a backlog
that grew fast) leaves them describing an empty table until autovacuum's next
round, and such a plan scans the whole group per batch. Members therefore
check the counters and run ANALYZE themselves when the table changed a lot.
"""

from __future__ import annotations

from functools import cache

from psycopg import sql as psql
from sqlalchemy import BigInteger, bindparam, column, func, select, table
from sqlalchemy.sql import Executable

stat_tables = table(
    "pg_stat_user_tables",
    column("relid"),
    column("n_live_tup", BigInteger),
    column("n_mod_since_analyze", BigInteger),
    column("last_analyze"),
    column("last_autoanalyze"),
    schema="pg_catalog",
)


@cache
def delivery_changes() -> Executable:
    """(rows changed since the last analyze, live rows, seconds since it) of `:relation`."""
    s = stat_tables
    last = func.greatest(s.c.last_analyze, s.c.last_autoanalyze)
    return select(
        s.c.n_mod_since_analyze,
        s.c.n_live_tup,
        func.extract("epoch", func.now() - last),
    ).where(s.c.relid == func.to_regclass(bindparam("relation")))


def analyze(schema: str) -> psql.Composed:
    """`ANALYZE <schema>.delivery` (the schema quoted as an identifier)."""
    return psql.SQL("ANALYZE {}.delivery").format(psql.Identifier(schema))
