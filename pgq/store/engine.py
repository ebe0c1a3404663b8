"""Where PostgreSQL comes from: `pgq.connect()`.

Resolution order: the `dsn` argument (the CLI's `--dsn`), then `$PGQ_DSN`, then
the embedded server under `$PGQ_HOME` (started on first use and reused). The
schema is the `schema` argument, then `$PGQ_SCHEMA`, then `pgq`; it is applied
through SQLAlchemy's `schema_translate_map`, so every statement pgq builds runs
against the chosen schema.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.adapt import Dumper
from psycopg.types import numeric
from sqlalchemy import Connection, Dialect, Engine, create_engine, event
from sqlalchemy.pool import NullPool

from pgq.errors import BadDsn, ConfigError
from pgq.schema import SCHEMA_PLACEHOLDER

DEFAULT_SCHEMA = "pgq"
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def resolve_dsn(dsn: str | None = None) -> str:
    """The libpq connection string to use: `dsn`, `$PGQ_DSN`, else the embedded server."""
    if dsn:
        return dsn
    env = os.environ.get("PGQ_DSN")
    if env:
        return env
    from pgq import embedded

    return embedded.ensure_running()


def resolve_schema(schema: str | None = None) -> str:
    """The schema name to use: `schema`, `$PGQ_SCHEMA`, else `pgq` (validated)."""
    name = schema or os.environ.get("PGQ_SCHEMA") or DEFAULT_SCHEMA
    if not _SCHEMA_RE.fullmatch(name):
        raise ConfigError(
            f"invalid schema name {name!r}: use lower-case letters, digits and _ (max 63)"
        )
    if name.startswith("pg_") or name == "information_schema":
        raise ConfigError(f"invalid schema name {name!r}: reserved by PostgreSQL")
    return name


def check_dsn(dsn: str) -> None:
    """Raise `BadDsn` with one line if `dsn` is not a libpq URL or key=value string,
    or is a URL whose user name or password libpq would read differently than it
    was written (`_misread_userinfo`)."""
    try:
        psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        # libpq quotes the address (or the part it could not read, a password
        # say): never repeat what is quoted
        raise BadDsn(f"invalid database address: {redact_quoted(first_line(exc))}") from None
    if _misread_userinfo(dsn):
        raise BadDsn(
            "invalid database address: an '@' or '/' in a URL's user name or password"
            " must be percent-encoded (%40, %2F); or give the password in PGPASSWORD,"
            " ~/.pgpass or a service file"
        )


_URL_SCHEMES = ("postgresql://", "postgres://")
_SAFE_VALUE = re.compile(r"[A-Za-z0-9._:,/\[\]%+-]{1,200}", re.ASCII)


def _misread_userinfo(dsn: str) -> bool:
    """Whether `dsn` is a URL with a raw `@` that libpq does not take as the end of
    the user name and password.

    libpq ends the userinfo at the first `@` before any `/`: in
    `postgresql://u:p@ss@host/db` the password is `p` and the host `ss@host`, so
    every error about that "host" printed part of the password (issue 21); with a
    `/` in the password (`u:p/ss@host`) there is no userinfo at all and the user
    and password become the host and port. Either way a raw `@` is left after
    the userinfo, before the query string.
    """
    scheme = next((p for p in _URL_SCHEMES if dsn.startswith(p)), None)
    if scheme is None:
        return False
    rest = dsn[len(scheme) :]
    at, slash = rest.find("@"), rest.find("/")
    if at != -1 and (slash == -1 or at < slash):
        rest = rest[at + 1 :]
    return "@" in rest.partition("?")[0]


def has_password(dsn: str) -> bool:
    """Whether `dsn` carries a password (False for an address libpq cannot parse)."""
    try:
        return bool(psycopg.conninfo.conninfo_to_dict(dsn).get("password"))
    except psycopg.ProgrammingError:
        return False


def describe_dsn(params: str | Mapping[str, Any]) -> str:
    """What pgq may say about a database address: its host, hostaddr, port and
    dbname as libpq parsed them (`host=db1 port=5432 dbname=app`), never the user
    name, the password or any other option.

    A value with characters outside a plain host, port or name (`…`) is not
    shown. `check_dsn` refuses a URL whose userinfo libpq would misread, so the
    host shown is never part of a password. `params` is a connection string or
    libpq's parsed keywords; an address libpq cannot parse describes as `""`.
    """
    if isinstance(params, str):
        try:
            params = psycopg.conninfo.conninfo_to_dict(params)
        except psycopg.ProgrammingError:
            return ""
    parts = []
    for key in ("host", "hostaddr", "port", "dbname"):
        value = params.get(key)
        if value is None or value == "":
            continue
        text = str(value)
        parts.append(f"{key}={text if _SAFE_VALUE.fullmatch(text) else '…'}")
    return " ".join(parts)


def redact_quoted(text: str) -> str:
    """`text` with every double-quoted part replaced by `…`: libpq quotes what it
    could not parse (a password, say) in its error messages."""
    return re.sub(r'"[^"]*"', '"…"', text)


def connect_failure(exc: BaseException, params: Mapping[str, Any]) -> str:
    """A driver's connection error as pgq may print it: its first line, then the
    address as `describe_dsn` renders it, with the DSN's user name (the server
    quotes it: `role "..." does not exist`) and password nowhere in it."""
    where = describe_dsn(params)
    text = first_line(exc) + (f" ({where})" if where else "")
    for secret in (params.get("user"), params.get("password")):
        if secret:  # as a quoted value only: a bare `x` is also in "exist"
            text = text.replace(f'"{secret}"', '"…"').replace(f"'{secret}'", "'…'")
    return text


def _connecting_safely(dialect: Dialect) -> None:
    """Make every connection error of `dialect` carry `connect_failure`'s text.

    It wraps the dialect's own `connect`, which SQLAlchemy calls after every
    `do_connect` listener (so a listener that supplies a password still runs); the
    error keeps its class, and nothing chains the original text, so no log line
    or traceback can print it.
    """
    connect = dialect.connect

    def connect_safely(*cargs: Any, **cparams: Any) -> Any:
        try:
            return connect(*cargs, **cparams)
        except psycopg.Error as exc:
            safe = type(exc)(connect_failure(exc, cparams))
        raise safe

    setattr(dialect, "connect", connect_safely)  # noqa: B010 - mypy: a method


class _IntDumper(numeric.IntDumper):
    """psycopg's dumper of `int`, with `integer` (int4) for every value that fits it
    where psycopg sends a small one as `smallint` (int2)."""

    def upgrade(self, obj: int, format: Any) -> Dumper:
        if -(2**31) <= obj < 2**31:
            return self._int4_dumper
        return super().upgrade(obj, format)


class _IntBinaryDumper(numeric.IntBinaryDumper):
    """`_IntDumper` for the binary format."""

    def upgrade(self, obj: int, format: Any) -> Dumper:
        if -(2**31) <= obj < 2**31:
            return self._int4_dumper
        return super().upgrade(obj, format)


def _ints_as_int4(dbapi_connection: Any, _record: Any) -> None:
    """Send a Python `int` that fits as `integer` on this connection, never `smallint`.

    The statements compare a group id with `group_id = $n::INTEGER` (SQLAlchemy
    writes the cast): a `smallint` parameter makes that `int4($n)`, a function
    call, not the parameter itself. Once a statement is prepared (psycopg, after 5
    runs on a connection) PostgreSQL tries its generic plan (after 5 more), and
    there Citus cannot prune on a function of a parameter: it ran on every shard
    (`UPDATE breaker SET next_probe_at = now() + $1 WHERE group_id = $2::INTEGER`
    from its 11th run, and the open, the failure write; tests/citus/test_generic_plans.py).
    An `integer` parameter under an `::INTEGER` cast is the parameter: one shard."""
    adapters = dbapi_connection.adapters
    adapters.register_dumper(int, _IntDumper)
    adapters.register_dumper(int, _IntBinaryDumper)


def connect(
    dsn: str | None = None,
    *,
    schema: str | None = None,
    pool_size: int | None = 10,
    session_dsn: str | None = None,
    **engine_kwargs: Any,
) -> Engine:
    """Return a SQLAlchemy `Engine` for pgq.

    `dsn` is a libpq URL (`postgresql://user@host/db`) or key=value string
    (`host=... dbname=...`). Without it, `$PGQ_DSN` is used, else the embedded
    server under `$PGQ_HOME` is started (or reused). No connection is opened
    here; the first statement opens one. `pool_size=None` makes an engine
    without a pool: every connection is opened and closed for its user.

    `session_dsn` (else `$PGQ_SESSION_DSN`, else `dsn` itself) is where a consumer
    member opens its one session connection (liveness lock, LISTEN, probe lock):
    give it when `dsn` points at a pooler in transaction mode (PgBouncer), which
    cannot keep a session's locks (DESIGN §7, "Connections").
    """
    conninfo = resolve_dsn(dsn)
    check_dsn(conninfo)
    session = session_dsn or os.environ.get("PGQ_SESSION_DSN") or conninfo
    if session != conninfo:
        check_dsn(session)
    name = resolve_schema(schema)
    if pool_size is None:
        engine_kwargs["poolclass"] = NullPool
    else:
        engine_kwargs.setdefault("pool_size", pool_size)
        engine_kwargs.setdefault("max_overflow", pool_size)
        engine_kwargs.setdefault("pool_pre_ping", True)
    driver_args = {
        **psycopg.conninfo.conninfo_to_dict(conninfo),
        **engine_kwargs.pop("connect_args", {}),
    }
    engine = create_engine("postgresql+psycopg://", connect_args=driver_args, **engine_kwargs)
    _connecting_safely(engine.dialect)
    event.listen(engine, "connect", _ints_as_int4)
    return engine.execution_options(
        schema_translate_map={SCHEMA_PLACEHOLDER: name},
        pgq_conninfo=conninfo,
        pgq_session_conninfo=session,
    )


def schema_of(bind: Engine | Connection) -> str:
    """The schema name an engine or connection was set up for."""
    options = bind.get_execution_options()
    translate = options.get("schema_translate_map") or {}
    return str(translate.get(SCHEMA_PLACEHOLDER, DEFAULT_SCHEMA))


def conninfo_of(engine: Engine) -> str:
    """The libpq connection string behind an engine made by `connect`."""
    conninfo = engine.get_execution_options().get("pgq_conninfo")
    if conninfo:
        return str(conninfo)
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def session_conninfo_of(engine: Engine) -> str:
    """Where a member's session connection goes: the engine's `session_dsn`, else
    its own connection string."""
    session = engine.get_execution_options().get("pgq_session_conninfo")
    return str(session) if session else conninfo_of(engine)


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text (driver errors are multi-line)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def with_connect_timeout(dsn: str, seconds: int) -> str:
    """`dsn` with `connect_timeout=seconds` added unless it (or `$PGCONNECT_TIMEOUT`)
    sets one already: a wrong host then fails in seconds, not after the OS's TCP
    timeout. Raises `BadDsn` for an address libpq cannot parse."""
    check_dsn(dsn)
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    if "connect_timeout" in params or os.environ.get("PGCONNECT_TIMEOUT"):
        return dsn
    return psycopg.conninfo.make_conninfo(dsn, connect_timeout=seconds)


def session_options(
    conninfo: str, *, application_name: str, idle_in_transaction: float, pooled: bool
) -> tuple[str, dict[str, Any]]:
    """The connection string and driver arguments of one of a consumer member's
    connections: `conninfo` named `application_name`.

    A direct session ends any transaction left idle for `idle_in_transaction`
    seconds (`idle_in_transaction_session_timeout`): a member process paused
    between two statements of a transaction (SIGSTOP, a stalled host) would
    otherwise hold its row locks for as long as it is paused, and the other
    members' claims, sweeps and counters would skip or wait for those rows. pgq's
    own transactions never idle: their statements follow one another at once.

    It also runs with `jit = off`: pgq's statements are short, and the planner's
    cost estimate for a statement that looks up live members in pg_locks per row
    (the drain check of `until_empty`) crosses `jit_above_cost`, so a server with
    JIT spent ~0.6 s compiling it at the end of every drain (measured on
    PostgreSQL 15), for a statement that runs in 2 ms.

    A `pooled` connection (through PgBouncer in transaction mode) sends neither:
    a pooler refuses startup `options` or drops them (set the server's or the
    role's `jit`, and the pooler's `idle_transaction_timeout`, instead), and it
    prepares no statement, which a transaction-mode pooler cannot keep between
    transactions.
    """
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    params["application_name"] = application_name
    if pooled:
        return psycopg.conninfo.make_conninfo("", **params), {"prepare_threshold": None}
    timeout = f"-c idle_in_transaction_session_timeout={max(1, round(idle_in_transaction * 1000))}"
    params["options"] = f"{params.get('options') or ''} {timeout} -c jit=off".strip()
    return psycopg.conninfo.make_conninfo("", **params), {}
