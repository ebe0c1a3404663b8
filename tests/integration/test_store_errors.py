"""Driver errors become pgq errors by SQLSTATE class, provoked for real (issue 8, deliverable 1).

Each test makes the real server (or, where the network is the point, a closed
port) fail in one way and checks that `wrap_errors()` raises exactly the pgq
error of that class, with a one-line message and never a psycopg or SQLAlchemy
type; then that `RoleConnection.retrying` retries only an outage.

Logins: the test server may trust 127.0.0.1 (`pg_hba` method `trust`), and then
a wrong password is accepted and cannot be provoked. The wrong-password test
then skips, saying so, and the refusals libpq reports without a SQLSTATE are
checked against the server for an unknown role, an unknown database and a role
without LOGIN, and on the wire (a stand-in that refuses the login with
PostgreSQL's own messages) for a failed password and a `pg_hba.conf` reject.

Roles made here are unique per run (pid and a random suffix) and dropped at the
end of each test, also when it fails. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import wait_until
from psycopg import sql
from sqlalchemy import Connection, Engine, event, select, text
from sqlalchemy import exc as sa_exc

import pgq
from pgq import schema as t
from pgq.errors import (
    BadDsn,
    DatabaseError,
    DatabaseUnavailable,
    InvalidData,
    InvalidPayload,
    LockNotAvailable,
    PermissionDenied,
    PgqError,
    SchemaMissing,
    StatementTimeout,
    TransactionConflict,
)
from pgq.store import RoleConnection, wrap_errors

BOUND = 10.0
"""Seconds any wait of these tests may take."""

AT_ONCE = 5.0
"""Seconds within which `retrying` gives up "at once" here: a loaded machine's
connection and statement, with room; a retry loop runs until the stop (BOUND)."""

PASSWORD = "pgq-test-password"
"""Every role made here logs in with this (a server may ask for one)."""


# --- helpers -------------------------------------------------------------------


def check(err: BaseException | None, kind: type[PgqError]) -> PgqError:
    """`err` is exactly a `kind` (not a subclass, never a driver type), with one line."""
    assert err is not None, f"nothing raised, expected {kind.__name__}"
    assert not isinstance(err, psycopg.Error | sa_exc.SQLAlchemyError), repr(err)
    assert type(err) is kind, f"{type(err).__name__} ({err}) instead of {kind.__name__}"
    message = str(err)
    assert message.strip() and "\n" not in message, repr(message)
    return err


def expect(kind: type[PgqError], action: Callable[[], object]) -> PgqError:
    """Run `action` inside `wrap_errors()`; it must raise `kind` (see `check`)."""
    with pytest.raises(PgqError) as info, wrap_errors():
        action()
    return check(info.value, kind)


def run_sql(engine: Engine, statement: str, params: dict[str, Any] | None = None) -> None:
    """`statement` in one transaction on a fresh connection of `engine`."""
    with engine.begin() as conn:
        conn.execute(text(statement), params or {})


def with_params(dsn: str, **params: Any) -> str:
    """`dsn` with `params` set (a None value removes the parameter)."""
    return psycopg.conninfo.make_conninfo(dsn, **params)


def backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def backend_state(admin: psycopg.Connection[Any], pid: int) -> str | None:
    """What `pg_stat_activity` says backend `pid` is doing (None once it is gone)."""
    row = admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return None if row is None else str(row[0])


def gone(admin: psycopg.Connection[Any], pid: int) -> None:
    wait_until(lambda: backend_state(admin, pid) is None, BOUND, f"backend {pid} to exit")


@contextlib.contextmanager
def once_running(admin: psycopg.Connection[Any], pid: int, action: str) -> Iterator[None]:
    """In a thread: once backend `pid` runs a statement, `SELECT action(pid)` on `admin`."""
    failures: list[BaseException] = []

    def act() -> None:
        try:
            wait_until(lambda: backend_state(admin, pid) == "active", BOUND, f"{pid} busy")
            admin.execute(sql.SQL("SELECT {}(%s)").format(sql.Identifier(action)), [pid])
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=act, name=f"{action}-{pid}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(BOUND)
    assert not thread.is_alive() and not failures, failures


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A superuser session on the test database (autocommit)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def make_role(pg_dsn: str) -> Iterator[Callable[..., str]]:
    """Create a role unique to this run: `make_role(login=True, password=PASSWORD)`.

    Every role made is dropped at the end of the test, also when it failed: its
    sessions ended, its grants in the test database revoked (DROP OWNED BY).
    """
    made: list[str] = []

    def make(login: bool = True, password: str = PASSWORD) -> str:
        name = f"pgq_err_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        statement = sql.SQL("CREATE ROLE {} {} PASSWORD {}").format(
            sql.Identifier(name),
            sql.SQL("LOGIN" if login else "NOLOGIN"),
            sql.Literal(password),
        )
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(statement)
        made.append(name)
        return name

    yield make
    failures: list[str] = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in made:
            try:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    [name],
                )
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
            except psycopg.Error as exc:
                failures.append(f"{name}: {exc}")
    assert not failures, f"roles left behind: {failures}"


@contextlib.contextmanager
def engine_for(dsn: str, schema: str) -> Iterator[Engine]:
    """A pool-less pgq engine on `dsn`, disposed afterwards."""
    eng = pgq.connect(dsn, schema=schema, pool_size=None)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local TCP port that refuses connections: bound (so nobody else takes it), not listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.fixture
def pair(engine: Engine, schema: str) -> str:
    """A table `pair` with rows 1 and 2 in this test's schema; its qualified name."""
    table = f'"{schema}".pair'
    run_sql(engine, f"CREATE TABLE {table} (id int PRIMARY KEY, n int NOT NULL)")
    run_sql(engine, f"INSERT INTO {table} VALUES (1, 0), (2, 0)")
    return table


# --- connection: an outage, not a bad address -----------------------------------


def test_a_closed_port_is_an_outage_not_a_bad_dsn(pg_dsn, schema, closed_port):
    dsn = with_params(pg_dsn, host="127.0.0.1", port=closed_port, connect_timeout=5)
    with engine_for(dsn, schema) as eng:
        err = expect(DatabaseUnavailable, lambda: eng.connect().close())
        assert str(err).startswith("cannot reach the database: ")
        # and through the public API, which runs inside wrap_errors itself
        with pytest.raises(PgqError) as info:
            pgq.create_topic(eng, "orders")
        check(info.value, DatabaseUnavailable)


def test_a_backend_terminated_while_idle_is_an_outage(engine, admin):
    with engine.connect() as conn:
        pid = backend_pid(conn)
        conn.rollback()
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        gone(admin, pid)
        err = expect(DatabaseUnavailable, lambda: conn.execute(text("SELECT 1")))
    assert "terminating connection" in str(err)


def test_a_backend_terminated_mid_statement_is_an_outage(engine, admin):
    with engine.connect() as conn:
        pid = backend_pid(conn)
        conn.execute(text("SET statement_timeout = '10s'"))  # bounded even if nobody kills it
        with once_running(admin, pid, "pg_terminate_backend"):
            expect(DatabaseUnavailable, lambda: conn.execute(text("SELECT pg_sleep(5)")))


def test_an_idle_in_transaction_timeout_ends_the_session_an_outage(engine, admin):
    """25P03: the server closed the session (was `DatabaseError`, so a role kept the dead link)."""
    with engine.connect() as conn:
        pid = backend_pid(conn)
        conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = 100"))
        gone(admin, pid)
        err = expect(DatabaseUnavailable, lambda: conn.execute(text("SELECT 1")))
    assert "idle-in-transaction timeout" in str(err)


def test_a_role_connection_reconnects_after_its_backend_is_terminated(engine, admin):
    role = RoleConnection(engine, "test", threading.Event())
    try:
        pid = role.run(backend_pid)
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        gone(admin, pid)
        with pytest.raises(PgqError) as info:
            role.run(backend_pid)
        check(info.value, DatabaseUnavailable)
        assert role.run(backend_pid) != pid  # the dead connection was thrown away
    finally:
        role.close()


# --- the login or the database refused: a bad address ------------------------------


def test_an_unknown_database_is_a_bad_dsn(pg_dsn, schema):
    dsn = with_params(pg_dsn, dbname=f"pgq_missing_{uuid.uuid4().hex[:8]}")
    with engine_for(dsn, schema) as eng:
        err = expect(BadDsn, lambda: eng.connect().close())
    assert "does not exist" in str(err)


def test_an_unknown_role_is_a_bad_dsn(pg_dsn, schema):
    name = f"pgq_nobody_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with engine_for(with_params(pg_dsn, user=name, password=PASSWORD), schema) as eng:
        err = expect(BadDsn, lambda: eng.connect().close())
    # a server that asks for a password does not say whether the role exists; the
    # role is the DSN's user name, which pgq never prints (issue 21)
    assert name not in str(err)
    assert 'role "…" does not exist' in str(err) or (
        'password authentication failed for user "…"' in str(err)
    )


def test_a_role_without_login_is_a_bad_dsn(pg_dsn, schema, make_role):
    """28000 "not permitted to log in" (was `DatabaseUnavailable`: retried forever)."""
    name = make_role(login=False)
    with engine_for(with_params(pg_dsn, user=name, password=PASSWORD), schema) as eng:
        err = expect(BadDsn, lambda: eng.connect().close())
    assert "not permitted to log in" in str(err)


def test_a_wrong_password_is_a_bad_dsn(pg_dsn, schema, make_role):
    name = make_role(password="right-password")
    dsn = with_params(pg_dsn, user=name, password="wrong-password")
    with engine_for(dsn, schema) as eng:
        try:
            with wrap_errors():
                eng.connect().close()
        except PgqError as exc:
            err: PgqError = exc
        else:
            pytest.skip(
                "the server accepted a wrong password (pg_hba method trust for this host): "
                "a failed password cannot be provoked here"
            )
    check(err, BadDsn)
    assert "password authentication failed" in str(err)


@contextlib.contextmanager
def refusing_server(sqlstate: str, message: str) -> Iterator[str]:
    """A one-connection TCP stand-in that refuses the login as PostgreSQL does.

    It declines SSL/GSS encryption, asks for a cleartext password when `sqlstate`
    is 28P01 (as `password` auth does) and reads it, then sends PostgreSQL's
    FATAL ErrorResponse with `sqlstate` and `message`, and closes. Yields a DSN.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(BOUND)
    port = listener.getsockname()[1]

    def read(conn: socket.socket, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ConnectionError("client went away")
            data += chunk
        return data

    def serve() -> None:
        with contextlib.suppress(OSError), listener:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(BOUND)
                while True:  # SSLRequest / GSSENCRequest are declined, then the startup packet
                    (length,) = struct.unpack("!i", read(conn, 4))
                    body = read(conn, length - 4)
                    if length == 8 and struct.unpack("!i", body)[0] in (80877103, 80877104):
                        conn.sendall(b"N")
                        continue
                    break
                if sqlstate == "28P01":
                    conn.sendall(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
                    read(conn, 1)  # 'p', the PasswordMessage
                    (length,) = struct.unpack("!i", read(conn, 4))
                    read(conn, length - 4)
                fields = (("S", "FATAL"), ("V", "FATAL"), ("C", sqlstate), ("M", message))
                body = b"".join(k.encode() + v.encode() + b"\0" for k, v in fields) + b"\0"
                conn.sendall(b"E" + struct.pack("!i", len(body) + 4) + body)

    thread = threading.Thread(target=serve, name="refusing-server", daemon=True)
    thread.start()
    try:
        yield (
            f"postgresql://pgq_user:secret@127.0.0.1:{port}/pgq"
            "?sslmode=disable&gssencmode=disable&connect_timeout=5"
        )
    finally:
        thread.join(BOUND + 1)
        listener.close()
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("sqlstate", "message"),
    [
        ("28P01", 'password authentication failed for user "pgq_user"'),
        (
            "28000",
            'pg_hba.conf rejects connection for host "127.0.0.1", user "pgq_user", '
            'database "pgq", no encryption',
        ),
    ],
    ids=["wrong-password", "pg-hba-reject"],
)
def test_a_login_refused_on_the_wire_is_a_bad_dsn(schema, sqlstate, message):
    """The server's refusal reaches us as text without a SQLSTATE (libpq keeps none at connect)."""
    with refusing_server(sqlstate, message) as dsn, engine_for(dsn, schema) as eng:
        err = expect(BadDsn, lambda: eng.connect().close())
    # the DSN's user name, quoted by the server, is never printed (issue 21)
    assert message.replace('"pgq_user"', '"…"') in str(err)
    assert "pgq_user" not in str(err)


# --- privileges -----------------------------------------------------------------------


def test_a_missing_privilege_is_permission_denied(pg_dsn, schema, engine, admin, make_role):
    name = make_role()
    pgq.create_topic(engine, "orders")
    with engine_for(with_params(pg_dsn, user=name, password=PASSWORD), schema) as eng:

        def read_messages() -> None:
            with eng.connect() as conn:
                conn.execute(select(t.message)).all()

        err = expect(PermissionDenied, read_messages)
        assert str(err) == f"permission denied: permission denied for schema {schema}"

        grant = sql.SQL("GRANT USAGE ON SCHEMA {} TO {}")
        admin.execute(grant.format(sql.Identifier(schema), sql.Identifier(name)))
        err = expect(PermissionDenied, read_messages)
        # PostgreSQL names the table, not the privilege (SELECT) it lacks
        assert str(err) == "permission denied: permission denied for table message"

        with pytest.raises(PgqError) as info:
            pgq.publish(eng, "orders", {"n": 1})
        # a refused publish names every privilege the producer lacks
        assert "lacks privileges a producer needs" in str(check(info.value, PermissionDenied))


# --- data -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "params", "words"),
    [
        # psycopg refuses it before sending: no SQLSTATE (was `DatabaseError`)
        ("SELECT CAST(:p AS text)", {"p": "a\x00b"}, "NUL (0x00)"),
        ("SELECT 'abc'::int", {}, 'invalid input syntax for type integer: "abc"'),
        ("SELECT CAST(:p AS numeric(3, 1))", {"p": 1000}, "numeric field overflow"),
        ("SELECT 2147483647::int + 1", {}, "integer out of range"),
    ],
    ids=["nul-byte-param", "abc-as-int", "numeric-overflow", "int-overflow"],
)
def test_a_refused_value_is_invalid_data(engine, statement, params, words):
    err = expect(InvalidData, lambda: run_sql(engine, statement, params))
    assert str(err).startswith("the database refused a value: ") and words in str(err)


def test_publishing_a_refused_value_is_invalid_data(engine):
    pgq.create_topic(engine, "orders")
    with pytest.raises(PgqError) as info:
        pgq.publish(engine, "orders", {"text": "a\x00b"})  # jsonb: 22P05
    check(info.value, InvalidData)
    with pytest.raises(PgqError) as info:  # a key is checked before it is sent
        pgq.publish(engine, "orders", {"n": 1}, key="k\x00")
    check(info.value, InvalidPayload)


# --- conflicts ------------------------------------------------------------------------


def test_a_deadlock_is_a_transaction_conflict(engine, pair):
    both_locked = threading.Barrier(2, timeout=BOUND)
    outcomes: dict[int, BaseException | None] = {}

    def lock_in_order(first: int, second: int) -> None:
        try:
            with wrap_errors(), engine.connect() as conn, conn.begin():
                conn.execute(text("SET LOCAL lock_timeout = '10s'"))  # bounded without a deadlock
                bump = text(f"UPDATE {pair} SET n = n + 1 WHERE id = :id")
                conn.execute(bump, {"id": first})
                both_locked.wait()
                conn.execute(bump, {"id": second})
            outcomes[first] = None
        except BaseException as exc:
            outcomes[first] = exc

    threads = [
        threading.Thread(target=lock_in_order, args=order, daemon=True)
        for order in ((1, 2), (2, 1))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * BOUND)
    assert not any(thread.is_alive() for thread in threads)
    failed = [exc for exc in outcomes.values() if exc is not None]
    assert len(outcomes) == 2 and len(failed) == 1, outcomes  # one victim, one commits
    err = check(failed[0], TransactionConflict)
    assert str(err).startswith("transaction conflict: deadlock detected")


def test_a_serialization_failure_is_a_transaction_conflict(engine, pair):
    repeatable = engine.execution_options(isolation_level="REPEATABLE READ")
    with repeatable.connect() as conn:
        conn.begin()
        conn.execute(text(f"SELECT n FROM {pair} WHERE id = 1"))  # the snapshot is taken
        run_sql(engine, f"UPDATE {pair} SET n = n + 1 WHERE id = 1")  # a concurrent commit
        err = expect(
            TransactionConflict,
            lambda: conn.execute(text(f"UPDATE {pair} SET n = n + 10 WHERE id = 1")),
        )
        conn.rollback()
    assert "could not serialize access" in str(err)


@pytest.mark.parametrize(
    ("setting", "statement", "words"),
    [
        ("lock_timeout = 50", "UPDATE {pair} SET n = 0 WHERE id = 1", "lock timeout"),
        (
            "lock_timeout = '10s'",
            "SELECT * FROM {pair} WHERE id = 1 FOR UPDATE NOWAIT",
            "obtain lock",
        ),
    ],
    ids=["lock-timeout", "nowait"],
)
def test_a_lock_not_available_is_a_transaction_conflict(engine, pair, setting, statement, words):
    """55P03 (was `DatabaseUnavailable`: "cannot reach the database", and retried):
    `LockNotAvailable`, a transaction conflict (57c2666 named it so housekeeping
    can tell it apart)."""

    def run() -> None:
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL {setting}"))
            conn.execute(text(statement.format(pair=pair)))

    with engine.connect() as holder:
        holder.begin()
        holder.execute(text(f"UPDATE {pair} SET n = n + 1 WHERE id = 1"))
        err = expect(LockNotAvailable, run)
        holder.rollback()
    assert isinstance(err, TransactionConflict)
    assert words in str(err)


# --- timeouts -------------------------------------------------------------------------


def test_a_statement_timeout_is_a_statement_timeout(engine):
    with engine.connect() as conn:
        conn.execute(text("SET statement_timeout = 50"))
        started = time.monotonic()
        err = expect(StatementTimeout, lambda: conn.execute(text("SELECT pg_sleep(5)")))
    assert time.monotonic() - started < 2.5  # ended by the timeout, not the sleep's end
    assert str(err) == "statement cancelled: canceling statement due to statement timeout"


def test_a_cancelled_statement_is_a_statement_timeout(engine, admin):
    with engine.connect() as conn:
        pid = backend_pid(conn)
        conn.execute(text("SET statement_timeout = '10s'"))
        with once_running(admin, pid, "pg_cancel_backend"):
            err = expect(StatementTimeout, lambda: conn.execute(text("SELECT pg_sleep(5)")))
    assert "canceling statement due to user request" in str(err)


# --- schema ---------------------------------------------------------------------------


def test_an_undefined_table_or_schema_is_schema_missing(engine, schema, pg_dsn):
    expect(SchemaMissing, lambda: run_sql(engine, f'SELECT * FROM "{schema}".no_such_table'))
    missing = f"never_{uuid.uuid4().hex[:8]}"
    expect(SchemaMissing, lambda: run_sql(engine, f"CREATE TABLE {missing}.t (a int)"))  # 3F000
    with engine_for(pg_dsn, missing) as eng, pytest.raises(PgqError) as info:
        pgq.create_topic(eng, "orders")  # a schema never migrated
    assert "pgq init" in str(check(info.value, SchemaMissing))


# --- anything else --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "words"),
    [
        ("SELEC 1", 'syntax error at or near "SELEC"'),
        ("SELECT no_such_function()", "does not exist"),
        # 54000 (program limit): psycopg files it under OperationalError; it was
        # "cannot reach the database" and retried as an outage
        ("SELECT 'a' || chr(0)", "null character not permitted"),
    ],
    ids=["syntax", "undefined-function", "program-limit"],
)
def test_anything_else_is_a_database_error(engine, statement, words):
    def run() -> None:
        with engine.connect() as conn:
            conn.exec_driver_sql(statement)

    err = expect(DatabaseError, run)
    assert str(err).startswith("database error: ") and words in str(err)


def test_a_unique_violation_is_a_database_error(engine, pair):
    err = expect(DatabaseError, lambda: run_sql(engine, f"INSERT INTO {pair} VALUES (1, 0)"))
    assert "duplicate key value violates unique constraint" in str(err)


# --- the retry policy -----------------------------------------------------------------


class Calls:
    """`RoleConnection.retrying(fn)` in a thread, with `fn`'s calls counted."""

    def __init__(self, engine: Engine, fn: Callable[[Connection, int], Any]) -> None:
        self.stop = threading.Event()
        self.role = RoleConnection(engine, "test", self.stop)
        self.fn, self.count = fn, 0
        self.error: BaseException | None = None
        self.value: Any = None
        self.after_stop: float | None = None
        """Seconds from the stop (of `run(stop_when=...)`) to the end of `retrying`."""

    def _call(self, conn: Connection) -> Any:
        self.count += 1
        return self.fn(conn, self.count)

    def _run(self) -> None:
        try:
            self.value = self.role.retrying(self._call)
        except BaseException as exc:
            self.error = exc

    def run(
        self, stop_after: float | None = None, stop_when: Callable[[], object] | None = None
    ) -> float:
        """Run; set the stop event after `stop_after` seconds, or once `stop_when()`
        is true (else only on failure).

        Returns how long `retrying` took; fails if it outlives the bounded wait.
        """
        started = time.monotonic()
        thread = threading.Thread(target=self._run, name="retrying", daemon=True)
        thread.start()
        stopped = None
        if stop_after is not None:
            thread.join(stop_after)
            self.stop.set()
        elif stop_when is not None:
            wait_until(stop_when, BOUND, "the moment to stop")
            stopped = time.monotonic()
            self.stop.set()
        thread.join(BOUND)
        if stopped is not None and not thread.is_alive():
            self.after_stop = time.monotonic() - stopped
        alive = thread.is_alive()
        self.stop.set()  # ends a runaway retry loop before failing
        thread.join(BOUND)
        self.role.close()
        assert not alive, f"retrying still running after {self.count} calls"
        return time.monotonic() - started


def serialization_failure(pair: str) -> Callable[[Connection, int], Any]:
    def fn(conn: Connection, _: int) -> Any:
        conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        conn.execute(text(f"SELECT n FROM {pair} WHERE id = 1"))
        run_sql(conn.engine, f"UPDATE {pair} SET n = n + 1 WHERE id = 1")
        return conn.execute(text(f"UPDATE {pair} SET n = n + 10 WHERE id = 1"))

    return fn


def deadlock_reported(conn: Connection, _: int) -> Any:
    # the deadlock itself is provoked in test_a_deadlock_is_a_transaction_conflict
    return conn.execute(
        text("DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = '40P01'; END $$")
    )


def statements(*texts: str) -> Callable[[Connection, int], Any]:
    def fn(conn: Connection, _: int) -> Any:
        for statement in texts:
            conn.execute(text(statement))

    return fn


def cannot_read(role: str) -> Callable[[Connection, int], Any]:
    def fn(conn: Connection, _: int) -> Any:
        conn.execute(text(f'SET LOCAL ROLE "{role}"'))
        return conn.execute(select(t.message)).all()

    return fn


@pytest.mark.parametrize(
    "case",
    ["serialization-failure", "deadlock", "permission-denied", "invalid-data", "timeout"],
)
def test_retrying_raises_a_non_outage_at_once(engine, pair, make_role, case):
    fn: Callable[[Connection, int], Any]
    kind: type[PgqError]
    if case == "serialization-failure":
        fn, kind = serialization_failure(pair), TransactionConflict
    elif case == "deadlock":
        fn, kind = deadlock_reported, TransactionConflict
    elif case == "permission-denied":
        fn, kind = cannot_read(make_role()), PermissionDenied
    elif case == "invalid-data":
        fn, kind = statements("SELECT 'abc'::int"), InvalidData
    else:
        fn = statements("SET LOCAL statement_timeout = 50", "SELECT pg_sleep(1)")
        kind = StatementTimeout
    calls = Calls(engine, fn)
    took = calls.run()
    check(calls.error, kind)
    assert calls.count == 1 and took < AT_ONCE


def terminate_self(conn: Connection, _: int) -> Any:
    return conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))


def test_retrying_retries_an_outage_until_stopped(engine, caplog):
    caplog.set_level(logging.WARNING, logger="pgq.store")
    calls = Calls(engine, terminate_self)
    # stopped as the backoff's fifth nap (1.6 s: 0.1 s doubled each time) begins
    calls.run(stop_when=lambda: "role=test attempt=5 " in caplog.text)
    check(calls.error, DatabaseUnavailable)
    assert calls.count >= 2, calls.count  # retried, on a new connection each time
    assert calls.after_stop is not None
    assert calls.after_stop < 1.0, calls.after_stop  # the stop ends the nap at once


def test_retrying_rides_out_an_outage(engine):
    def fn(conn: Connection, call: int) -> Any:
        return terminate_self(conn, call) if call < 3 else backend_pid(conn)

    calls = Calls(engine, fn)
    calls.run()
    assert calls.error is None and calls.count == 3 and calls.value > 0


def test_retrying_retries_a_closed_port_until_stopped(pg_dsn, schema, closed_port):
    dsn = with_params(pg_dsn, host="127.0.0.1", port=closed_port, connect_timeout=5)
    with engine_for(dsn, schema) as eng:
        attempts: list[object] = []
        event.listen(eng, "do_connect", lambda *args: attempts.append(args))
        calls = Calls(eng, lambda conn, _: None)
        calls.run(stop_after=1.0)
    check(calls.error, DatabaseUnavailable)
    assert calls.count == 0 and len(attempts) >= 2, attempts


def test_retrying_does_not_retry_a_bad_dsn(pg_dsn, schema):
    dsn = with_params(pg_dsn, dbname=f"pgq_missing_{uuid.uuid4().hex[:8]}")
    with engine_for(dsn, schema) as eng:
        attempts: list[object] = []
        event.listen(eng, "do_connect", lambda *args: attempts.append(args))
        calls = Calls(eng, lambda conn, _: None)
        took = calls.run()
    check(calls.error, BadDsn)
    assert len(attempts) == 1 and took < AT_ONCE
