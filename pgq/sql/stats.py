"""Planner statistics and dead rows of the delivery table: are they stale, and
refresh them.

The claim and outcome statements run as prepared statements whose plans are
only as good as the table's statistics. A burst onto a new table (or a backlog
that grew fast) leaves them describing an empty table until autovacuum's next
round, and such a plan scans the whole group per batch. Members therefore
check the counters and run ANALYZE themselves when the table changed a lot.

Every message leaves about three dead row versions in `delivery` (claim, ack,
prune), so a busy table fills with them faster than autovacuum, which looks at a
database once a minute, comes round: at 12,000 messages/s the table grew to
~400 MB for ~10,000 live rows. Members that own the table VACUUM it themselves
when dead rows dominate (decision 0021).
"""

from __future__ import annotations

from functools import cache

from psycopg import sql as psql
from sqlalchemy import BigInteger, bindparam, column, func, select, table
from sqlalchemy.sql import Executable

from pgq.sql import catalog

stat_tables = table(
    "pg_stat_user_tables",
    column("relid"),
    column("n_live_tup", BigInteger),
    column("n_dead_tup", BigInteger),
    column("n_mod_since_analyze", BigInteger),
    column("last_analyze"),
    column("last_autoanalyze"),
    column("last_vacuum"),
    column("last_autovacuum"),
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


@cache
def delivery_dead() -> Executable:
    """(dead rows, live rows, seconds since the last vacuum, may this session vacuum
    it: the owner or a member of the owner's role) of `:relation`."""
    s = stat_tables
    last = func.greatest(s.c.last_vacuum, s.c.last_autovacuum)
    return (
        select(
            s.c.n_dead_tup,
            s.c.n_live_tup,
            func.extract("epoch", func.now() - last),
            func.pg_has_role(catalog.classes.c.relowner, "USAGE"),
        )
        .select_from(s.join(catalog.classes, catalog.classes.c.oid == s.c.relid))
        .where(s.c.relid == func.to_regclass(bindparam("relation")))
    )


def vacuum(schema: str) -> psql.Composed:
    """`VACUUM (SKIP_LOCKED) <schema>.delivery`: skipped while another vacuum runs."""
    return psql.SQL("VACUUM (SKIP_LOCKED) {}.delivery").format(psql.Identifier(schema))
