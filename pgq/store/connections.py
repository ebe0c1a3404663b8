"""The connections a member's roles share, and the one retry policy.

A member runs on three connections (DESIGN §7, decision 0027), each a `Link` named
`pgq/<group>/<member>/<role>` in `pg_stat_activity`:

- `session`: the member's liveness lock, LISTEN, the probe lock and the heartbeat
  (lease extension, the quorum check). Direct or session-pooled: `session_dsn`.
- `claims`: the fetcher's claims and the prober's probes; once claiming has
  stopped, the abort and the final pass (an outcome write stuck behind a lock
  may still hold `work` then).
- `work`: start-up, outcomes, housekeeping and VACUUM.

Roles on one link take turns (one transaction at a time). The last two work
through PgBouncer in transaction mode: when a `session_dsn` is given, the DSN is
taken for a pooler, and its connections prepare no statements and send no
startup `options`.

- `RoleConnection`: a role's use of a link, each call one transaction, retried
  with exponential backoff while the database is unavailable.
- `SessionLock`: a session-level advisory lock held on a link: the group's probe
  lock (`probe_lock`, whose session the server ends once it idles for
  `breaker.member_ttl` while held) and each member's liveness lock (`member_lock`).
- `Listener`: LISTEN on the session link for the schema's publish channel.
- `run_once`: one transaction on a pooled connection, for one-off calls.
- `run_hot`: a hot-path statement compiled once and run on the driver's cursor.

A role connection or a lock also takes an `Engine` instead of a link: it then
runs on a link of its own.
"""

from __future__ import annotations

import contextlib
import math
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import psycopg
from psycopg import sql as psql
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Engine
from sqlalchemy.sql import ClauseElement, Executable
from tenacity import Retrying, retry_if_exception, wait_exponential

from pgq.errors import DatabaseUnavailable
from pgq.logcontext import get_logger
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import breaker as breaker_sql
from pgq.sql import members as member_sql
from pgq.sql.locks import (
    idle_session_timeout,
    lock_key,
    lock_timeout,
    repeatable_read,
    try_session_lock,
    unlock_session,
)
from pgq.sql.publish import notify_channel
from pgq.store.engine import connect, conninfo_of, schema_of, session_conninfo_of, session_options
from pgq.store.errors import wrap_errors

logger = get_logger("pgq.store")
T = TypeVar("T")

STOP_CHECK = 0.2
"""Longest stretch an idle listener waits without looking at its stop event."""

IDLE_SESSION_TIMEOUT_SINCE = 140000
"""The first server version (`server_version_num`) with `idle_session_timeout`."""

CLOSE_WAIT = 1.0
"""Seconds `Link.close` waits for a role's statement before leaving it to the role."""

TURN_CHECK = 0.05
"""Seconds between a waiting role's looks at its stop event."""

RECONNECT_EVERY = 0.5
"""Seconds between a listener's tries to open its session again after losing it."""


class LinkBusy(DatabaseUnavailable):
    """A stopping role gave up waiting for its link (another role's statement held it)."""


KEEP_SHARE = 1 / 3
"""A lock whose session ends when idle is touched at least this often (share of the limit)."""


class Link:
    """One connection that roles take turns on (`lock`: one transaction at a time).

    Opened on first use and again after it was lost (`generation` counts the
    sessions; `on_connect` hooks run on each new one, LISTEN say). Made from an
    engine of its own (`owned`: disposed with the link) or from a caller's engine,
    whose pool then lends the connection.
    """

    def __init__(self, engine: Engine, role: str, *, owned: bool = False) -> None:
        self.engine = engine
        self.role = role
        self.owned = owned
        self.lock = threading.RLock()
        self.conn: Connection | None = None
        self.generation = 0
        """How many sessions this link has opened: a lock taken in an earlier one is gone."""
        self.running: str | None = None
        """The role whose transaction runs now (what `cancel` would stop)."""
        self.closing = False
        """`close` was asked for: the role whose turn outlasted it closes the link."""
        self._cancelling = threading.Lock()
        """Held while a cancel request is in flight: the role it targets cannot end
        its turn meanwhile."""
        self._cancel_sent = False
        """A cancel request went out during this turn: the session may still hold it
        (the server acts on it at its next interrupt check, which can come in the
        next statement), so the turn's end throws the session away."""
        self._hooks: list[Callable[[Connection], None]] = []

    def connection(self) -> Connection:
        """The open connection, opened (and its hooks run) when there is none; call
        with `lock` held and inside `wrap_errors`."""
        if self.conn is None:
            conn = self.engine.connect()
            try:
                for hook in self._hooks:
                    with conn.begin():
                        hook(conn)
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.close()
                raise
            self.conn = conn
            self.generation += 1
        return self.conn

    def on_connect(self, hook: Callable[[Connection], None]) -> None:
        """Run `hook(conn)` (in a transaction) on every session this link opens, the
        open one included."""
        with self.lock:
            self._hooks.append(hook)
            if self.conn is not None:
                try:
                    with wrap_errors(), self.conn.begin():
                        hook(self.conn)
                except DatabaseUnavailable:
                    self.discard()
                    raise

    def discard(self) -> None:
        """Throw the connection away (broken, or left in an unknown state)."""
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.invalidate()
        with contextlib.suppress(Exception):
            conn.close()

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Close the connection (a caller's engine gets it back in its pool). A role
        whose statement still runs after `wait` seconds (an outcome write stuck
        behind a lock, at the end of a shutdown that gave up on it) is left to
        finish it, never cancelled (a cancelled outcome write would read as the
        database refusing it): the role closes the link once it is done."""
        if not self.lock.acquire(timeout=wait):
            self.closing = True
            logger.warning("connection still busy at close role=%s", self.running)
            return
        try:
            self._close()
        finally:
            self.lock.release()

    def _close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        if self.owned:
            self.engine.dispose()

    def leave(self) -> None:
        """A role's turn ends (call with `lock` held): close the link if `close` was
        asked for while the turn went on."""
        with self._cancelling:
            self.running = None
            cancel_sent, self._cancel_sent = self._cancel_sent, False
        if cancel_sent:
            self.discard()  # no request left pending can reach the next role's statement
        if self.closing:
            self.closing = False
            self._close()

    def take_turn(self, stop: threading.Event) -> None:
        """Wait for the link (`lock`), giving up with `LinkBusy` once `stop` is set:
        a stopping role must not wait out another role's stuck statement."""
        while not self.lock.acquire(timeout=TURN_CHECK):
            if stop.is_set():
                raise LinkBusy(f"the {self.role} connection is busy (role={self.running})")

    def cancel(self, role: str, timeout: float = 5.0) -> None:
        """Ask the server to cancel the statement `role` runs on this link, if it runs
        one now (from another thread; never another role's). The request opens a
        connection of its own and may wait up to `timeout` seconds: callers that must
        not wait run it on a thread of its own."""
        with self._cancelling:  # `role`'s turn cannot end before the request is in
            conn = self.conn
            if conn is None or self.running != role:
                return
            with contextlib.suppress(Exception):
                driver = conn.connection.driver_connection
                if driver is not None:
                    self._cancel_sent = True
                    driver.cancel_safe(timeout=timeout)


def private_link(engine: Engine, role: str) -> Link:
    """A link of its own on `engine`'s server, outside any pool (for a lock or
    LISTEN made from an engine: one session that lives as long as the link)."""
    own = connect(conninfo_of(engine), schema=schema_of(engine), pool_size=None)
    return Link(own, role, owned=True)


NAME_BYTES = 63
"""What PostgreSQL keeps of an `application_name`."""

TAIL = 10
"""Characters kept from the end of a member name cut to fit (a default name ends in
`pid:xxxx`: what tells two processes of one host apart)."""


def application_name(group: str, member: str, role: str) -> str:
    """`pgq/<group>/<member>/<role>` in PostgreSQL's 63 bytes: the role is always
    whole (it says which connection this is); a group name is cut to 20 bytes, then
    the member name loses its middle (`~` marks the cut), so its start (the host)
    and its end (pid and token) stay."""
    name = f"pgq/{group}/{member}/{role}"
    if len(name.encode()) <= NAME_BYTES:
        return name
    group = _cut(group, 20)
    room = NAME_BYTES - len(f"pgq/{group}//{role}".encode())
    if len(member.encode()) > room:
        tail = member[-TAIL:]
        member = _cut(member, room - len(tail.encode()) - 1) + "~" + tail
    return _cut(f"pgq/{group}/{member}/{role}", NAME_BYTES)


def _cut(text: str, most: int) -> str:
    """`text` cut to at most `most` bytes of UTF-8, never inside a character."""
    return text.encode()[: max(0, most)].decode(errors="ignore")


@dataclass(frozen=True)
class MemberLinks:
    """The three connections of one member (module docstring)."""

    session: Link
    claims: Link
    work: Link

    def close(self) -> None:
        for link in (self.claims, self.work, self.session):
            link.close()


def member_links(
    engine: Engine, group: str, member: str, *, idle_in_transaction: float
) -> MemberLinks:
    """The links a member runs on, each named `pgq/<group>/<member>/<role>`
    (`application_name`), on the server and schema of `engine`; the
    session on `engine`'s `session_dsn` when it has one (see `session_options`)."""
    schema = schema_of(engine)
    direct = session_conninfo_of(engine)
    pooled = direct != conninfo_of(engine)

    def link(role: str) -> Link:
        name = application_name(group, member, role)
        conninfo, extra = session_options(
            direct if role == "session" else conninfo_of(engine),
            application_name=name,
            idle_in_transaction=idle_in_transaction,
            pooled=pooled and role != "session",
        )
        own = connect(conninfo, schema=schema, pool_size=None, connect_args=extra)
        return Link(own, role, owned=True)

    return MemberLinks(session=link("session"), claims=link("claims"), work=link("work"))


class RoleConnection:
    """A thread role's use of a link (`target`; an `Engine` lends one pooled
    connection to this role alone).

    `run(fn)` calls `fn(conn)` inside a transaction, the link's other roles waiting
    their turn; `run(fn, single=True)` is for an `fn` that runs exactly one hot
    statement (`run_hot`): it runs in autocommit, one round trip instead of three
    (BEGIN, the statement, COMMIT). When the database is unreachable the
    connection is thrown away (the next call opens a new one) and
    `DatabaseUnavailable` is raised; `retrying(fn)` retries that with exponential
    backoff until it works or `stop` is set.

    With `lock_timeout` (seconds), each transaction's statements wait at most that
    long for a lock, then fail with `LockNotAvailable` (the transaction rolls back):
    for work that may come back later rather than wait behind another session.
    """

    def __init__(
        self,
        target: Engine | Link,
        role: str,
        stop: threading.Event,
        *,
        lock_timeout: float | None = None,
    ) -> None:
        self.link = target if isinstance(target, Link) else Link(target, role)
        self._own_link = not isinstance(target, Link)
        self.role = role
        self.stop = stop
        self._lock_ms = None if lock_timeout is None else str(max(1, round(lock_timeout * 1000)))

    def run(
        self, fn: Callable[..., T], *args: Any, single: bool = False, snapshot: bool = False
    ) -> T:
        """`fn(conn, *args)` in one transaction on this role's connection (`single`:
        `fn` runs one hot statement, which commits by itself; no lock timeout;
        `snapshot`: every statement of `fn` sees one snapshot, REPEATABLE READ)."""
        link = self.link
        link.take_turn(self.stop)
        try:
            with wrap_errors():
                conn = link.connection()
                link.running = self.role
                if single:
                    return _autocommitted(conn, fn, *args)
                with conn.begin():
                    if snapshot:  # the transaction's first statement, as it must be
                        conn.execute(repeatable_read())
                    if self._lock_ms is not None:
                        conn.execute(lock_timeout(), {"ms": self._lock_ms})
                    return fn(conn, *args)
        except DatabaseUnavailable:
            link.discard()
            raise
        finally:
            link.leave()
            link.lock.release()

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

    def close(self) -> None:
        """Give a lent connection back to its engine's pool (a shared link stays:
        its member closes it)."""
        if self._own_link:
            self.link.close()

    def cancel(self, timeout: float = 5.0) -> None:
        """Cancel the statement this role runs now, if any (`Link.cancel`)."""
        self.link.cancel(self.role, timeout)


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
    """A session-level advisory lock held on a link (`target`; an `Engine` makes it a
    link of its own, outside any pool).

    `take`, `held` and `release` are the statements (with `params`) that try the
    lock, tell whether this session still holds it, and unlock. The lock goes with
    its session, so a dead process never keeps it; a link that opened a new
    session since (`Link.generation`) no longer holds it.

    With `idle_timeout`, the server ends the lock's session once it has been idle
    that long while the lock is held (`idle_session_timeout`, PostgreSQL 14 and
    later): a holder that stops answering (SIGSTOP, a hung host) loses the lock
    even though its connection lingers. The holder keeps the session busy by
    calling `check` at least every `keep_every` seconds. Older servers lack the
    setting: the lock then lasts as long as the session (one warning says so).
    """

    def __init__(
        self,
        target: Engine | Link,
        take: Executable,
        held: Executable,
        release: Executable,
        params: dict[str, Any] | None = None,
        *,
        idle_timeout: float | None = None,
    ) -> None:
        self.link = target if isinstance(target, Link) else private_link(target, "lock")
        self._own_link = not isinstance(target, Link)
        self._take, self._held, self._release = take, held, release
        self.params = params or {}
        self.idle_timeout = idle_timeout
        self.keep_every = math.inf if idle_timeout is None else idle_timeout * KEEP_SHARE
        """Longest stretch the holder may leave the session idle."""
        self._warned = False
        self._taken_in: int | None = None
        """The link's session (`generation`) in which the lock was taken."""

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in one transaction on the lock's session, if it is still
        the session that took the lock (else `LostLock`)."""
        link = self.link
        with link.lock:
            if link.conn is None or self._taken_in != link.generation:
                raise LostLock("the lock's session ended")
            try:
                with wrap_errors(), link.conn.begin():
                    return fn(link.conn, *args)
            except DatabaseUnavailable as exc:
                link.discard()
                raise LostLock(str(exc)) from exc

    def acquire(self) -> bool:
        """Try to take the lock; False if another session holds it."""
        link = self.link
        with link.lock:
            try:
                with wrap_errors():
                    conn = link.connection()
                    with conn.begin():
                        if (
                            self._taken_in == link.generation
                            and conn.execute(self._held, self.params).scalar()
                        ):
                            return True  # taken again would stack a second hold
                        if not conn.execute(self._take, self.params).scalar():
                            return False
                        self._end_when_idle(conn, self.idle_timeout)
                    self._taken_in = link.generation
                    return True
            except DatabaseUnavailable:
                link.discard()
                raise

    def _end_when_idle(self, conn: Connection, seconds: float | None) -> None:
        """Set the session's `idle_session_timeout` (None: never), where the server has it."""
        if self.idle_timeout is None:
            return
        driver = cast(psycopg.Connection[Any], conn.connection.driver_connection)
        version = driver.info.server_version
        if version >= IDLE_SESSION_TIMEOUT_SINCE:
            ms = 0 if seconds is None else max(1, round(seconds * 1000))
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
            held = self.run(lambda conn: conn.execute(self._held, self.params).scalar())
        except LostLock:
            raise
        except Exception as exc:
            raise LostLock(str(exc)) from exc
        if not held:
            raise LostLock("the lock is no longer held")

    def release(self) -> None:
        """Unlock (and end the idle limit) if this session holds the lock; a lock of
        its own link closes that too."""
        link = self.link
        with link.lock:
            if link.conn is not None and self._taken_in == link.generation:
                try:
                    with wrap_errors(), link.conn.begin():
                        if link.conn.execute(self._held, self.params).scalar():
                            link.conn.execute(self._release, self.params)
                        self._end_when_idle(link.conn, None)
                except Exception:
                    link.discard()  # a session that may still hold it must end
            self._taken_in = None
            if self._own_link:
                link.close()


def probe_lock(
    target: Engine | Link, group: str, *, idle_timeout: float | None = None
) -> SessionLock:
    """The lock that elects the prober of `group` (DESIGN §6.4); its session ends once
    idle for `idle_timeout` seconds while held (the prober passes `breaker.member_ttl`)."""
    key = probe_lock_key(schema_of(_engine_of(target)), group)
    return SessionLock(
        target,
        try_session_lock(key),
        breaker_sql.lock_held(key),
        unlock_session(key),
        idle_timeout=idle_timeout,
    )


def member_lock(target: Engine | Link, gid: int, member: str) -> SessionLock:
    """The lock a member's session holds while it runs: its liveness (DESIGN §6.2).

    It sets no idle limit: liveness also needs a heartbeat younger than
    `breaker.member_ttl`, so a paused member stops counting without losing it
    (unless it is the prober, whose shared session then ends: decision 0027).
    """
    return SessionLock(
        target,
        member_sql.take_session_lock(),
        member_sql.session_lock_held(),
        member_sql.release_session_lock(),
        {"gid": gid, "member": member, "table": f'"{schema_of(_engine_of(target))}".member'},
    )


def _engine_of(target: Engine | Link) -> Engine:
    return target.engine if isinstance(target, Link) else target


class Listener:
    """LISTEN for the schema's publish channel on a member's session link. Waiting
    holds the link only to collect what came: its other roles run between looks."""

    def __init__(self, link: Link, topic: str) -> None:
        self.link = link
        self.channel = notify_channel(schema_of(self.link.engine))
        self.topic = topic
        self._hooked = False
        self._seen = 0
        """The link's session in which this listener last looked."""
        self._failing = False
        """The last look found no session (logged once, until one is back)."""

    def _listen(self, conn: Connection) -> None:
        conn.exec_driver_sql(
            psql.SQL("LISTEN {}").format(psql.Identifier(self.channel)).as_string(None)
        )

    def _collect(self) -> bool | None:
        """Whether a publish to this topic was heard since the last look (True too
        when LISTEN only starts now: a publish before it sent nothing); None when
        there is no connection to listen on."""
        link = self.link
        with link.lock:
            try:
                with wrap_errors():
                    if not self._hooked:
                        link.on_connect(self._listen)
                        self._hooked = True
                    conn = link.connection()
                    if self._seen != link.generation:
                        self._seen = link.generation
                        heard = True
                    else:
                        driver = cast(psycopg.Connection[Any], conn.connection.driver_connection)
                        heard = any(n.payload == self.topic for n in driver.notifies(timeout=0))
            except (DatabaseUnavailable, psycopg.Error) as exc:
                link.discard()
                if not self._failing:
                    logger.warning("listen unavailable, polling instead error=%s", exc)
                self._failing = True
                return None
        if self._failing:
            logger.info("listen available again")
            self._failing = False
        return heard

    def _socket(self) -> int | None:
        conn = self.link.conn
        if conn is None:
            return None
        with contextlib.suppress(Exception):
            driver = cast(psycopg.Connection[Any], conn.connection.driver_connection)
            return driver.pgconn.socket
        return None

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Wait up to `timeout` (or until `stop`) for a publish to this topic.

        True if one came, or if LISTEN only starts now: a publish committed
        before it sent us nothing, so the caller must look again first.
        """
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            heard = self._collect()
            if heard:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fd = self._socket() if heard is not None else None
            if fd is None:  # the session is gone: open it again soon, LISTEN with it
                stop.wait(min(left, RECONNECT_EVERY))
                continue
            try:  # another role's statement wakes this too: the next look waits for it
                select.select([fd], [], [], min(left, STOP_CHECK))
            except (OSError, ValueError):
                stop.wait(min(left, STOP_CHECK))
        return False
