"""Versioned schema migrations: `pgq init` / `pgq.migrate(engine)`.

Safe when several processes run it at once: each migration run holds a
transaction-level advisory lock derived from the schema name, so the second
runner waits and then finds nothing to do. Each migration is applied in the
same transaction as its row in `schema_version`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import Connection, Engine, func, insert, select
from sqlalchemy.schema import CreateSchema

from pgq import schema as t
from pgq.errors import PgqError
from pgq.sql.locks import lock_key, xact_lock
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors

logger = logging.getLogger(__name__)


def _v1_initial(conn: Connection) -> None:
    # Version 1 is the tables as declared in pgq.schema. Once a release has
    # shipped, later changes become new migrations and this one is frozen.
    t.metadata.create_all(conn, checkfirst=False)


MIGRATIONS: tuple[tuple[int, str, Callable[[Connection], None]], ...] = (
    (1, "initial tables", _v1_initial),
)
LATEST = MIGRATIONS[-1][0]


def current_version(conn: Connection) -> int:
    """The schema version installed (0 when the schema is not installed)."""
    exists = conn.scalar(select(func.to_regclass(f"{schema_of(conn)}.schema_version")))
    if exists is None:
        return 0
    return int(conn.scalar(select(func.coalesce(func.max(t.schema_version.c.version), 0))) or 0)


def migrate(engine: Engine) -> int:
    """Create or upgrade pgq's schema; idempotent and concurrent-safe.

    Returns the schema version now installed.
    """
    schema = schema_of(engine)
    with wrap_errors(), engine.begin() as conn:
        conn.execute(xact_lock(lock_key(schema, "migrate")))
        conn.execute(CreateSchema(schema, if_not_exists=True))
        version = current_version(conn)
        if version > LATEST:
            raise PgqError(
                f"schema {schema} is at version {version}, newer than this pgq knows ({LATEST})"
            )
        for number, description, apply in MIGRATIONS:
            if number <= version:
                continue
            apply(conn)
            conn.execute(insert(t.schema_version).values(version=number))
            logger.info(
                "migration applied schema=%s version=%d what=%s", schema, number, description
            )
            version = number
    return version
