"""The database boundary: driver errors become pgq's own exceptions here.

Everything that talks to PostgreSQL runs inside `wrap_errors()`, so threads,
the breaker logic and the CLI never see a psycopg or SQLAlchemy exception type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
import psycopg.errors
from sqlalchemy import exc as sa_exc

from pgq.connect import first_line
from pgq.errors import BadDsn, DatabaseUnavailable, PgqError, SchemaMissing

# SQLSTATE classes that mean "the server or the connection is gone or refusing":
# 08 connection exception, 57P01-57P03 shutdown/cannot connect now, 53 resources.
_UNAVAILABLE_PREFIXES = ("08", "57P", "53")
# 28 invalid authorization, 3D000 invalid catalog (no such database)
_BAD_ADDRESS_PREFIXES = ("28", "3D")


def _driver_error(exc: BaseException) -> BaseException:
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def translate(exc: BaseException) -> PgqError | None:
    """The pgq exception for a driver exception, or None if it is not one we map."""
    err = _driver_error(exc)
    sqlstate = getattr(err, "sqlstate", None) or ""
    if isinstance(err, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName):
        return SchemaMissing()
    if sqlstate.startswith(_BAD_ADDRESS_PREFIXES):
        return BadDsn(f"cannot use the database: {first_line(err)}")
    if isinstance(err, psycopg.OperationalError | psycopg.InterfaceError) or sqlstate.startswith(
        _UNAVAILABLE_PREFIXES
    ):
        return DatabaseUnavailable(f"cannot reach the database: {first_line(err)}")
    if isinstance(exc, sa_exc.DisconnectionError | sa_exc.TimeoutError):
        return DatabaseUnavailable(f"cannot reach the database: {first_line(exc)}")
    return None


@contextlib.contextmanager
def wrap_errors() -> Iterator[None]:
    """Re-raise driver errors as `DatabaseUnavailable`, `BadDsn` or `SchemaMissing`."""
    try:
        yield
    except (sa_exc.DBAPIError, sa_exc.DisconnectionError, sa_exc.TimeoutError, psycopg.Error) as e:
        mapped = translate(e)
        if mapped is None:
            raise
        raise mapped from e
