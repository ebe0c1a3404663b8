"""Advisory lock keys, derived from the schema and what they guard, and how to see in
`pg_locks` whether a session holds one."""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    bindparam,
    cast,
    column,
    exists,
    false,
    func,
    literal,
    literal_column,
    select,
    table,
    text,
    true,
)
from sqlalchemy.sql import ColumnElement, Select, TextClause

pg_locks = table(
    "pg_locks",
    column("locktype"),
    column("database"),
    column("classid"),
    column("objid"),
    column("objsubid"),
    column("granted"),
    column("pid"),
    schema="pg_catalog",
)
_pg_database = table("pg_database", column("oid"), column("datname"), schema="pg_catalog")


def lock_key(*parts: str) -> int:
    """A stable signed 64-bit advisory lock key for `parts` (schema first)."""
    digest = hashlib.blake2b("\x1f".join(("pgq", *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _held_key() -> ColumnElement[Any]:
    """A pg_locks row's advisory key as the bigint it was taken with."""
    return (
        cast(pg_locks.c.classid, BigInteger)
        .op("<<")(literal_column("32"))
        .op("|")(cast(pg_locks.c.objid, BigInteger))
    )


def _held_in_this_database() -> list[ColumnElement[bool]]:
    here = select(_pg_database.c.oid).where(_pg_database.c.datname == func.current_database())
    return [
        pg_locks.c.locktype == literal("advisory"),
        pg_locks.c.granted,
        pg_locks.c.objsubid == literal(1),
        pg_locks.c.database == here.scalar_subquery(),
    ]


def held_advisory_keys() -> Select[Any]:
    """The session-level advisory lock keys some session of this database holds."""
    return select(_held_key()).select_from(pg_locks).where(*_held_in_this_database())


def advisory_held(key: ColumnElement[Any], *, this_session: bool = False) -> ColumnElement[bool]:
    """Some session of this database (or this very session) holds the session-level
    advisory lock `key` (a bigint expression, which pg_locks splits into classid and
    objid, objsubid 1)."""
    where = [*_held_in_this_database(), _held_key() == key]
    if this_session:
        where.append(pg_locks.c.pid == func.pg_backend_pid())
    return (
        select(literal(1)).select_from(pg_locks).where(*where).correlate_except(pg_locks).exists()
    )


def xact_lock(key: int) -> Select[tuple[None]]:
    """Wait for a transaction-scoped advisory lock (released at commit)."""
    return select(func.pg_advisory_xact_lock(key))


def xact_lock_shared(key: int) -> Select[tuple[None]]:
    """Wait for a transaction-scoped advisory lock in shared mode (released at commit)."""
    return select(func.pg_advisory_xact_lock_shared(key))


def topic_key(schema: str, topic: str) -> int:
    """The key of topic `topic`'s lock on Citus (`topic_lock`)."""
    return lock_key(schema, "topic", topic)


@cache
def topic_lock(*, shared: bool) -> Select[tuple[None]]:
    """Wait for topic `:key`'s lock (`topic_key`) for this transaction, on the
    coordinator: Citus's replacement for the topic row's lock, which on a reference
    table locks every topic (decision 0023, 3.4). Publishing and retention take it
    shared, a subscribe exclusively; each a statement of its own before the writes,
    so their snapshots are taken once it is held. On one server the row lock stays
    (`pgq.sql.publish.lock_topic_for_publish`): members of an earlier version take
    it during an upgrade."""
    lock = func.pg_advisory_xact_lock_shared if shared else func.pg_advisory_xact_lock
    return select(lock(bindparam("key", type_=BigInteger)))


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


@cache
def lock_timeout() -> Select[tuple[str]]:
    """Make this transaction's statements give up waiting for a lock after `:ms`
    milliseconds (SQLSTATE 55P03, `lock_timeout`); reset at its end."""
    return select(func.set_config(literal("lock_timeout"), bindparam("ms"), true()))


@cache
def repeatable_read() -> TextClause:
    """Make this transaction REPEATABLE READ: every later statement of it sees the
    snapshot its first one takes (must be its first statement)."""
    return text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")


def group_key(schema: str, group: str) -> int:
    """The lock a member's join takes shared and `pgq unsubscribe` exclusively
    (`xact_lock_shared`, `xact_lock`): a join either commits before the unsubscribe
    reads who is live, or waits for it and then finds the group gone."""
    return lock_key(schema, "group", group)


@cache
def mark_transaction() -> Select[tuple[str]]:
    """Mark this transaction with `:value` under the setting `:name` (gone at its end),
    and end it once it has been idle in transaction for `:idle_ms` milliseconds
    (a paused client's transaction must not hold its locks for ever)."""
    return select(
        func.set_config(bindparam("name"), bindparam("value"), true()),
        func.set_config(
            literal("idle_in_transaction_session_timeout"), bindparam("idle_ms"), true()
        ),
    )


@cache
def transaction_marked() -> Select[Any]:
    """This transaction's setting `:name` (empty when it is gone: the transaction that
    set it ended), and from now on end it once idle in it for `:idle_ms` milliseconds."""
    return select(
        func.current_setting(bindparam("name"), true()),
        func.set_config(
            literal("idle_in_transaction_session_timeout"), bindparam("idle_ms"), true()
        ),
    )


@cache
def end_backend() -> Select[tuple[bool]]:
    """Terminate server process `:pid` (one of this role's own sessions: its client is
    gone, or gave it up); true when it was there to signal."""
    return select(func.pg_terminate_backend(bindparam("pid", type_=Integer)))


@cache
def backend_alive() -> Select[tuple[bool]]:
    """Whether server process `:pid` still exists (its transaction not yet ended)."""
    a = table("pg_stat_activity", column("pid"), schema="pg_catalog")
    return select(exists().where(a.c.pid == bindparam("pid", type_=Integer)))
