"""The connections a member's roles own, and the one retry policy.

- `RoleConnection`: one pooled connection per thread role (fetcher, acker,
  heartbeat, maintenance, prober), each call one transaction, retried with
  exponential backoff while the database is unavailable.
- `SessionLock`: a dedicated connection outside any pool that holds a
  session-level advisory lock: the group's probe lock (`probe_lock`, whose
  session the server ends once it idles for `breaker.member_ttl`) and each
  member's liveness lock (`member_lock`).
- `Listener`: the fetcher's LISTEN connection (autocommit, outside the pool).
- `run_once`: one transaction on a pooled connection, for one-off calls.
- `run_hot`: a hot-path statement compiled once and run on the driver's cursor.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import psycopg
from psycopg import sql as psql
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Engine
from sqlalchemy.sql import ClauseElement, Executable
from tenacity import Retrying, retry_if_exception, wait_exponential

from pgq.errors import DatabaseUnavailable
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import breaker as breaker_sql
from pgq.sql import members as member_sql
from pgq.sql.locks import (
    idle_session_timeout,
    lock_key,
    lock_timeout,
    try_session_lock,
    unlock_session,
)
from pgq.sql.publish import notify_channel
from pgq.store.engine import connect, conninfo_of, schema_of
from pgq.store.errors import wrap_errors

logger = logging.getLogger("pgq.store")
T = TypeVar("T")

STOP_CHECK = 0.2
"""Longest stretch an idle listener waits without looking at its stop event."""

IDLE_SESSION_TIMEOUT_SINCE = 140000
"""The first server version (`server_version_num`) with `idle_session_timeout`."""

KEEP_SHARE = 1 / 3
"""A lock whose session ends when idle is touched at least this often (share of the limit)."""


class RoleConnection:
    """The one connection a consumer thread role owns.

    `run(fn)` calls `fn(conn)` inside a transaction; `run(fn, single=True)` is
    for an `fn` that runs exactly one hot statement (`run_hot`): it runs in
    autocommit, one round trip instead of three (BEGIN, the statement, COMMIT).
    When the database is unreachable the connection is thrown away (the next
    call opens a new one) and `DatabaseUnavailable` is raised; `retrying(fn)`
    retries that with exponential backoff until it works or `stop` is set.

    With `lock_timeout` (seconds), each transaction's statements wait at most that
    long for a lock, then fail with `LockNotAvailable` (the transaction rolls back):
    for work that may come back later rather than wait behind another session.
    """

    def __init__(
        self,
        engine: Engine,
        role: str,
        stop: threading.Event,
        *,
        lock_timeout: float | None = None,
    ) -> None:
        self.engine = engine
        self.role = role
        self.stop = stop
        self._lock_ms = None if lock_timeout is None else str(max(1, round(lock_timeout * 1000)))
        self._conn: Connection | None = None

    def run(self, fn: Callable[..., T], *args: Any, single: bool = False) -> T:
        """`fn(conn, *args)` in one transaction on this role's connection (`single`:
        `fn` runs one hot statement, which commits by itself; no lock timeout)."""
        try:
            with wrap_errors():
                if self._conn is None:
                    self._conn = self.engine.connect()
                if single:
                    return _autocommitted(self._conn, fn, *args)
                with self._conn.begin():
                    if self._lock_ms is not None:
                        self._conn.execute(lock_timeout(), {"ms": self._lock_ms})
                    return fn(self._conn, *args)
        except DatabaseUnavailable:
            self._discard()
            raise

    def retrying(self, fn: Callable[..., T], *args: Any, single: bool = False) -> T:
        """`run(fn, *args)`, retried with backoff while the database is unavailable.

        Gives up (re-raising) once the role's stop event is set.
        """
        try:
            return self.run(fn, *args, single=single)  # the common case, without tenacity
        except DatabaseUnavailable:
            if self.stop.is_set():
                raise
        gate = self.stop

        def nap(seconds: float) -> None:
            gate.wait(seconds)  # a stop ends the wait at once

        retryer = Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, DatabaseUnavailable)),
            wait=wait_exponential(multiplier=0.1, max=5.0),
            stop=lambda state: gate.is_set(),
            sleep=nap,
            before_sleep=lambda state: logger.warning(
                "database unavailable role=%s attempt=%d error=%s",
                self.role,
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
            reraise=True,
        )

        def attempt() -> T:
            return self.run(fn, *args, single=single)

        return retryer(attempt)

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.invalidate()
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        """Return the connection (if any) to the pool."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def cancel(self, timeout: float = 5.0) -> None:
        """Ask the server to cancel the statement running on this connection (from
        another thread; nothing happens when none runs). The request opens a
        connection of its own and may wait up to `timeout` seconds: callers that must
        not wait run it on a thread of its own."""
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception):
                driver = conn.connection.driver_connection
                if driver is not None:
                    driver.cancel_safe(timeout=timeout)


def _autocommitted(conn: Connection, fn: Callable[..., T], *args: Any) -> T:
    """`fn(conn, *args)` with the driver in autocommit: `fn` must run its statements
    through `run_hot` (on the driver, outside SQLAlchemy's transaction), each of
    which then commits by itself."""
    driver = conn.connection.driver_connection
    assert driver is not None
    driver.autocommit = True
    try:
        return fn(conn, *args)
    finally:
        if driver.closed:
            pass  # broken: the caller discards it (the error in flight says why)
        elif driver.info.transaction_status != TransactionStatus.IDLE:
            conn.invalidate()  # never hand out a connection left in autocommit
        else:
            driver.autocommit = False


def run_once(engine: Engine, fn: Callable[..., T], *args: Any) -> T:
    """`fn(conn, *args)` in one transaction on a pooled connection."""
    with wrap_errors(), engine.begin() as conn:
        return fn(conn, *args)


_compiled: dict[tuple[int, str], tuple[str, dict[str, Any]]] = {}


def driver_sql(conn: Connection, stmt: Executable) -> tuple[str, dict[str, Any]]:
    """`stmt` compiled once per schema for the driver: its SQL (the schema rendered
    in) and its default parameters."""
    schema = schema_of(conn)
    key = (id(stmt), schema)
    hit = _compiled.get(key)
    if hit is None:
        compiled = cast(ClauseElement, stmt).compile(
            dialect=conn.dialect,
            schema_translate_map={SCHEMA_PLACEHOLDER: schema},
            render_schema_translate=True,
        )
        hit = _compiled[key] = (compiled.string, dict(compiled.params))
    return hit


def run_hot(conn: Connection, stmt: Executable, params: dict[str, Any]) -> list[Any]:
    """Run a hot-path statement on the connection's psycopg cursor.

    The Core statement is compiled once per schema (`driver_sql`), so each call
    skips SQLAlchemy's per-execution work; it still runs in the SQLAlchemy
    connection's transaction (or, under `RoleConnection.run(..., single=True)`,
    commits by itself). Every hot statement has a RETURNING list: returns its rows
    as tuples.
    """
    sql, defaults = driver_sql(conn, stmt)
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    with driver.cursor() as cur:
        # prepared after a few calls (psycopg's default): planning the claim anew
        # each time costs ~1 ms of server CPU per batch. The plan is only as good
        # as the table's statistics, which the maintenance thread keeps fresh.
        cur.execute(sql, {**defaults, **params})
        return cur.fetchall()


def probe_lock_key(schema: str, group: str) -> int:
    """The advisory lock key that elects the prober of `group` in `schema`."""
    return lock_key(schema, "probe", group)


class LostLock(Exception):
    """The lock connection failed or no longer holds its lock."""


class SessionLock:
    """A session-level advisory lock on a dedicated connection (autocommit, no pool).

    `take`, `held` and `release` are the statements (with `params`) that try the
    lock, tell whether this session still holds it, and unlock. Closing the
    connection frees the lock too, so a dead process never keeps it.

    With `idle_timeout`, the server ends the lock's session once it has been idle
    that long (`idle_session_timeout`, PostgreSQL 14 and later): a holder that stops
    answering (SIGSTOP, a hung host) loses the lock even though its connection
    lingers. The holder keeps the session busy by calling `check` at least every
    `keep_every` seconds. Older servers lack the setting: the lock then lasts as
    long as the session (one warning says so).
    """

    def __init__(
        self,
        engine: Engine,
        take: Executable,
        held: Executable,
        release: Executable,
        params: dict[str, Any] | None = None,
        *,
        idle_timeout: float | None = None,
    ) -> None:
        self.engine = connect(
            conninfo_of(engine), schema=schema_of(engine), pool_size=None
        ).execution_options(isolation_level="AUTOCOMMIT")
        self._take, self._held, self._release = take, held, release
        self.params = params or {}
        self.idle_timeout = idle_timeout
        self.keep_every = math.inf if idle_timeout is None else idle_timeout * KEEP_SHARE
        """Longest stretch the holder may leave the session idle."""
        self._warned = False
        self.conn: Connection | None = None

    def acquire(self) -> bool:
        """Try to take the lock; False if another session holds it."""
        with wrap_errors():
            if self.conn is None:
                conn = self.engine.connect()
                try:
                    self._end_when_idle(conn)
                except BaseException:
                    with contextlib.suppress(Exception):
                        conn.close()
                    raise
                self.conn = conn
            return bool(self.conn.execute(self._take, self.params).scalar())

    def _end_when_idle(self, conn: Connection) -> None:
        """Set the new session's `idle_session_timeout`, where the server has it."""
        if self.idle_timeout is None:
            return
        driver = cast(psycopg.Connection[Any], conn.connection.driver_connection)
        version = driver.info.server_version
        if version >= IDLE_SESSION_TIMEOUT_SINCE:
            ms = max(1, round(self.idle_timeout * 1000))
            conn.execute(idle_session_timeout(), {"ms": str(ms)})
        elif not self._warned:
            self._warned = True
            logger.warning(
                "idle_session_timeout needs PostgreSQL 14 server_version=%d: a paused"
                " holder keeps its session lock for as long as its connection lasts",
                version,
            )

    def check(self) -> None:
        """Raise `LostLock` unless the connection answers and pg_locks shows the lock.

        Also what keeps a lock with `idle_timeout` alive: each call is a statement.
        """
        try:
            with wrap_errors():
                if self.conn is None:
                    raise LostLock("not connected")
                held = self.conn.execute(self._held, self.params).scalar()
        except Exception as exc:
            raise LostLock(str(exc)) from exc
        if not held:
            raise LostLock("the lock is no longer held")

    def release(self) -> None:
        """Unlock and close (closing alone would free the lock too)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.execute(self._release, self.params)
            with contextlib.suppress(Exception):
                conn.close()
        self.engine.dispose()


def probe_lock(engine: Engine, group: str, *, idle_timeout: float | None = None) -> SessionLock:
    """The lock that elects the prober of `group` (DESIGN §6.4); its session ends once
    idle for `idle_timeout` seconds (the prober passes `breaker.member_ttl`)."""
    key = probe_lock_key(schema_of(engine), group)
    return SessionLock(
        engine,
        try_session_lock(key),
        breaker_sql.lock_held(),
        unlock_session(key),
        idle_timeout=idle_timeout,
    )


def member_lock(engine: Engine, gid: int, member: str) -> SessionLock:
    """The lock a member's session holds while it runs: its liveness (DESIGN §6.2).

    Its session has no idle limit: liveness also needs a heartbeat younger than
    `breaker.member_ttl`, so a paused member stops counting without losing it.
    """
    return SessionLock(
        engine,
        member_sql.take_session_lock(),
        member_sql.session_lock_held(),
        member_sql.release_session_lock(),
        {"gid": gid, "member": member, "table": f'"{schema_of(engine)}".member'},
    )


class Listener:
    """A LISTEN connection for the schema's publish channel (autocommit, outside the pool)."""

    def __init__(self, engine: Engine, topic: str) -> None:
        self.conninfo = conninfo_of(engine)
        self.channel = notify_channel(schema_of(engine))
        self.topic = topic
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def _connect(self) -> psycopg.Connection[tuple[object, ...]] | None:
        if self._conn is None:
            try:
                conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5)
                conn.execute(psql.SQL("LISTEN {}").format(psql.Identifier(self.channel)))
                self._conn = conn
            except psycopg.Error as exc:
                logger.warning("listen unavailable, polling instead error=%s", exc)
        return self._conn

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Wait up to `timeout` (or until `stop`) for a publish to this topic.

        True if one came, or if LISTEN only starts now: a publish committed
        before it sent us nothing, so the caller must look again first.
        """
        if self._conn is None:
            if self._connect() is None:
                stop.wait(timeout)
                return False
            return True
        conn = self._conn
        deadline = time.monotonic() + timeout
        try:
            while not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for note in conn.notifies(timeout=min(left, STOP_CHECK)):
                    if note.payload == self.topic:
                        return True
        except psycopg.Error:
            self.close()
        return False

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
