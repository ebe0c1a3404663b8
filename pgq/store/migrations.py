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
from pgq.store.privileges import carry_grants_to_probe_log

logger = logging.getLogger(__name__)


def _v1_initial(conn: Connection) -> None:
    # A fresh install: the tables as declared in pgq.schema now. A database
    # that holds an older version as released (tests/fixtures/schemas/v<N>.sql)
    # gets the objects added since from the migrations below, which check what
    # exists first, so every path ends in the same schema
    # (tests/integration/test_upgrade.py).
    t.metadata.create_all(conn, checkfirst=False)


def _v2_charged_index(conn: Connection) -> None:
    # Reconciliation finds the rows an outage charged whatever their error class
    # (a row that died of reclaims too): index them by the epoch of their charge.
    # A fresh install already has it from version 1 (the tables as declared).
    t.charged_index.create(conn, checkfirst=True)


def _v3_probe_log(conn: Connection) -> None:
    # Every group probe with its outcome, for the breaker's timeline. A fresh
    # install already has it from version 1 (the tables as declared). Roles
    # granted a job before keep being able to do it (decision 0022).
    t.probe.create(conn, checkfirst=True)
    for statement in carry_grants_to_probe_log(conn):
        logger.info("migration granted schema=%s statement=%s", schema_of(conn), statement)


MIGRATIONS: tuple[tuple[int, str, Callable[[Connection], None]], ...] = (
    (1, "initial tables", _v1_initial),
    (2, "index of the rows an outage charged", _v2_charged_index),
    (3, "the probe log", _v3_probe_log),
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
