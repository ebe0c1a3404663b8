"""Is a schema placed on a Citus cluster? Asked once per process and schema.

A few statements take another shape on Citus (decision 0023): the claim reads the
messages in a statement of its own, and the topic locks are the coordinator's
advisory locks, not row locks on a reference table. Everything else is one code
base. A schema is distributed when its `delivery` table is (`pgq init --distributed`).
"""

from __future__ import annotations

import threading

from sqlalchemy import Connection, Engine, text

from pgq.store.engine import conninfo_of, schema_of

_known: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def distributed(engine: Engine, conn: Connection | None = None) -> bool:
    """True when `engine`'s schema is placed on Citus (cached for the process)."""
    key = (conninfo_of(engine), schema_of(engine))
    with _lock:
        known = _known.get(key)
    if known is not None:
        return known
    delivery = f'"{key[1]}".delivery'
    if conn is None:
        with engine.connect() as c:
            answer = bool(_ask(c, delivery))
    else:
        answer = bool(_ask(conn, delivery))
    with _lock:
        _known[key] = answer
    return answer


def _ask(conn: Connection, delivery: str) -> bool:
    if not conn.scalar(text("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL")):
        return False
    return bool(
        conn.scalar(
            text(
                "SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition"
                " WHERE logicalrelid = to_regclass(:delivery))"
            ),
            {"delivery": delivery},
        )
    )


def forget(engine: Engine) -> None:
    """Drop what is known of `engine`'s schema (after `migrate(distributed=True)`)."""
    with _lock:
        _known.pop((conninfo_of(engine), schema_of(engine)), None)
