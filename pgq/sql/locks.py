"""Advisory lock keys, derived from the schema and what they guard."""

from __future__ import annotations

import hashlib

from sqlalchemy import bindparam, false, func, literal, select
from sqlalchemy.sql import Select


def lock_key(*parts: str) -> int:
    """A stable signed 64-bit advisory lock key for `parts` (schema first)."""
    digest = hashlib.blake2b("\x1f".join(("pgq", *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def xact_lock(key: int) -> Select[tuple[None]]:
    """Wait for a transaction-scoped advisory lock (released at commit)."""
    return select(func.pg_advisory_xact_lock(key))


def xact_lock_shared(key: int) -> Select[tuple[None]]:
    """Wait for a transaction-scoped advisory lock in shared mode (released at commit)."""
    return select(func.pg_advisory_xact_lock_shared(key))


def breaker_flip_key(schema: str, group: str) -> int:
    """The lock an open of `group`'s breaker takes exclusively and a purge shared: a
    purge never deletes on the view of a breaker that opened while it ran."""
    return lock_key(schema, "breaker-flip", group)


def try_session_lock(key: int) -> Select[tuple[bool]]:
    """Try a session-level advisory lock; true when this session now holds it."""
    return select(func.pg_try_advisory_lock(key))


def unlock_session(key: int) -> Select[tuple[bool]]:
    """Release a session-level advisory lock."""
    return select(func.pg_advisory_unlock(key))


def try_xact_lock(key: int) -> Select[tuple[bool]]:
    """Try a transaction-scoped advisory lock (released at commit); never waits."""
    return select(func.pg_try_advisory_xact_lock(key))


def idle_session_timeout() -> Select[tuple[str]]:
    """End this session once it has been idle for `:ms` milliseconds (PostgreSQL 14+)."""
    return select(func.set_config(literal("idle_session_timeout"), bindparam("ms"), false()))
