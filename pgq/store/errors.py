"""Driver errors become pgq's own exceptions here, by SQLSTATE class.

Everything that talks to PostgreSQL runs inside `wrap_errors()`, so the
consumer's threads, the breaker logic and the CLI never see a psycopg or
SQLAlchemy exception type:

| SQLSTATE class                          | pgq error            |
| --------------------------------------- | -------------------- |
| 08 connection, 57P01-57P05, 53 resources | `DatabaseUnavailable` |
| 25P03 idle-in-transaction timeout        | `DatabaseUnavailable` |
| 28 authorization, 3D000 no such database | `BadDsn`              |
| 42501 insufficient privilege             | `PermissionDenied`    |
| 42P01 undefined table, 3F000 no schema   | `SchemaMissing`       |
| 42703 undefined column (an older schema) | `SchemaMissing`       |
| 22 data exception                        | `InvalidData`         |
| 40 serialization failure, deadlock       | `TransactionConflict` |
| 55P03 lock not available (lock_timeout)  | `LockNotAvailable`    |
| 57014 query cancelled (statement timeout)| `StatementTimeout`    |
| anything else the driver raises          | `DatabaseError`       |

A connection that fails before the server answers carries no SQLSTATE (nor
does a connection lost mid-statement); it is an outage (`DatabaseUnavailable`)
unless its words say that no retry can help (`_REFUSED_AT_CONNECT`): the server
refused the login or the database, or the DSN asks for what cannot be done
(an option value libpq or psycopg rejects, SSL from a server without it). An
error that does carry a SQLSTATE came from a server that answered: outside the
table it is a `DatabaseError`, whatever psycopg's class for it (psycopg files
classes 54, 55 and 58 under `OperationalError` too). A value psycopg refuses
before sending it (a NUL byte in a text parameter) is `InvalidData`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
from sqlalchemy import exc as sa_exc

from pgq.errors import (
    BadDsn,
    DatabaseError,
    DatabaseUnavailable,
    InvalidData,
    LockNotAvailable,
    PermissionDenied,
    PgqError,
    SchemaMissing,
    StatementTimeout,
    TransactionConflict,
)
from pgq.store.engine import first_line

# (SQLSTATE prefix, error, what the one line says), most specific first
_BY_SQLSTATE: tuple[tuple[str, type[PgqError], str], ...] = (
    ("57014", StatementTimeout, "statement cancelled"),
    ("57P", DatabaseUnavailable, "cannot reach the database"),
    ("08", DatabaseUnavailable, "cannot reach the database"),
    ("53", DatabaseUnavailable, "cannot reach the database"),
    ("25P03", DatabaseUnavailable, "cannot reach the database"),  # the server ended the session
    ("28", BadDsn, "cannot use the database"),
    ("3D", BadDsn, "cannot use the database"),
    ("42501", PermissionDenied, "permission denied"),
    ("42P01", SchemaMissing, ""),
    # a column of a later version: code deployed before its migration ran
    ("42703", SchemaMissing, "the pgq schema is older than this pgq: run `pgq init`"),
    ("3F000", SchemaMissing, ""),
    ("22", InvalidData, "the database refused a value"),
    ("40", TransactionConflict, "transaction conflict"),
    ("55P03", LockNotAvailable, "lock not available"),  # lock_timeout, NOWAIT
)

# What libpq (or psycopg, for `connect_timeout`) says when a connection cannot be
# made as the DSN asks, whoever tries again: the server refused the login or the
# database, or the DSN asks for something the client or the server cannot do.
# These errors reach us without a SQLSTATE, so their words are all there is.
_REFUSED_AT_CONNECT = (
    # the server refused: a wrong password (any method), no such role or database,
    # pg_hba.conf, no CONNECT privilege, NOLOGIN, ALLOW_CONNECTIONS false
    "authentication failed",
    "no password supplied",
    "does not exist",
    "no pg_hba.conf entry",
    "pg_hba.conf rejects connection",
    "permission denied for database",
    "is not permitted to log in",
    "is not currently accepting connections",
    # the DSN cannot be honoured: a bad option value, SSL or GSSAPI encryption the
    # server does not offer, channel binding, certificates, require_auth
    'value: "',
    "invalid port number",
    "invalid connection option",
    "bad value for connect_timeout",
    "but SSL was required",
    "GSSAPI encryption required",
    "channel binding",
    "certificate",
    "authentication method",
)
"""Words of a connection error that no retry can fix (it becomes `BadDsn`)."""


def driver_error(exc: BaseException) -> BaseException:
    """The driver's exception behind a SQLAlchemy wrapper (or `exc` itself)."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def sqlstate_of(exc: BaseException) -> str:
    """The SQLSTATE of a driver exception, walking causes and SQLAlchemy wrappers."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = getattr(driver_error(current), "sqlstate", None)
        if state:
            return str(state)
        current = current.__cause__ or current.__context__
    return ""


def translate(exc: BaseException) -> PgqError:
    """The pgq exception for a driver exception."""
    err = driver_error(exc)
    sqlstate = sqlstate_of(exc)
    for prefix, kind, what in _BY_SQLSTATE:
        if sqlstate.startswith(prefix):
            return kind(f"{what}: {first_line(err)}" if what else None)
    if isinstance(err, psycopg.DataError):  # refused before sending: no SQLSTATE
        return InvalidData(f"the database refused a value: {first_line(err)}")
    text = first_line(err)
    if sqlstate:  # the server answered
        return DatabaseError(f"database error: {text}")
    unreached = isinstance(err, psycopg.OperationalError | psycopg.InterfaceError)
    refused = unreached or isinstance(err, psycopg.ProgrammingError)  # psycopg's own checks
    if refused and any(words in text for words in _REFUSED_AT_CONNECT):
        return BadDsn(f"cannot use the database: {text}")
    if unreached or isinstance(exc, sa_exc.DisconnectionError | sa_exc.TimeoutError):
        return DatabaseUnavailable(f"cannot reach the database: {text}")
    return DatabaseError(f"database error: {text}")


@contextlib.contextmanager
def wrap_errors() -> Iterator[None]:
    """Re-raise any driver error as the pgq error `translate` maps it to."""
    try:
        yield
    except (sa_exc.DBAPIError, sa_exc.DisconnectionError, sa_exc.TimeoutError, psycopg.Error) as e:
        raise translate(e) from e
