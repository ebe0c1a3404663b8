"""Is a schema placed on a Citus cluster? Asked once per process and schema.

A few statements take another shape on Citus (decision 0023): the claim reads the
messages in a statement of its own, and the topic locks are the coordinator's
advisory locks, not row locks on a reference table. Everything else is one code
base. A schema is distributed when its `delivery` table is (`pgq init --distributed`).
"""

from __future__ import annotations

import threading

from sqlalchemy import Connection, Engine

from pgq.store.engine import conninfo_of, schema_of

_known: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def distributed(bind: Engine | Connection) -> bool:
    """True when the schema of `bind` (an engine, or a connection, asked on itself) is
    placed on Citus (cached for the process)."""
    key = _key(bind)
    with _lock:
        known = _known.get(key)
    if known is not None:
        return known
    delivery = f'"{key[1]}".delivery'
    if isinstance(bind, Engine):
        with bind.connect() as c:
            answer = bool(_ask(c, delivery))
    else:
        answer = bool(_ask(bind, delivery))
    with _lock:
        _known[key] = answer
    return answer


def _key(bind: Engine | Connection) -> tuple[str, str]:
    conninfo = bind.get_execution_options().get("pgq_conninfo")
    if conninfo is None:  # an engine not made by `pgq.connect`
        engine = bind if isinstance(bind, Engine) else bind.engine
        conninfo = conninfo_of(engine)
    return str(conninfo), schema_of(bind)


def _ask(conn: Connection, delivery: str) -> bool:
    """Asked on the driver's cursor: the connection may be a hot-path one running in
    autocommit (`pgq.store.connections.run_hot`), where a SQLAlchemy statement would
    begin a transaction of its own."""
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cur:
        cur.execute("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL")
        row = cur.fetchone()
        if not (row and row[0]):
            return False
        cur.execute(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition"
            " WHERE logicalrelid = to_regclass(%s))",
            (delivery,),
        )
        row = cur.fetchone()
        return bool(row and row[0])


def forget(engine: Engine) -> None:
    """Drop what is known of `engine`'s schema (after `migrate(distributed=True)`)."""
    with _lock:
        _known.pop(_key(engine), None)
