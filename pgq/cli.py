"""The `pgq` command: a thin click layer over pgq's plain functions.

Adding a command is one small function: decorate it with `@cli.command()` (or
`@<subgroup>.command()`), take `state: State` through `@pass_state`, call the
library through `state.engine` / `state.settings`, and print with `emit`. Errors
need no handling there: `PgqGroup` turns every user-facing `PgqError` into one
line on stderr (`pgq: error: ...`) and exit code 2, never a traceback. A command
with other exit-code rules (`check`, `consume`) catches what it needs itself.

This is the only place that installs logging handlers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import click
import psycopg.conninfo
from sqlalchemy import Engine

from pgq import monitor as st
from pgq.connect import check_dsn, connect, schema_of
from pgq.errors import (
    DatabaseUnavailable,
    EmbeddedServerError,
    InvalidPayload,
    PgqError,
    UsageError,
)
from pgq.settings import Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])

CONNECT_TIMEOUT = 5
"""Seconds a CLI command waits for the server before it gives up (unless the DSN says)."""

EXIT_USAGE = 2
"""Bad usage, bad configuration, or a database that cannot be used (DESIGN §7)."""

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOG_DATEFMT = "%Y-%m-%dT%H:%M:%S"


# --- errors -------------------------------------------------------------------


class CliError(click.ClickException):
    """A failure shown as one line, `pgq: error: <message>`, with its exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()) or "error")

    def show(self, file: IO[Any] | None = None) -> None:
        """Write the one line to stderr."""
        click.echo(f"pgq: error: {self.format_message()}", err=True, file=file)


def cli_error(exc: PgqError) -> CliError:
    """Exit 2 for user errors and an unusable database, 1 for anything else pgq raised."""
    if isinstance(exc, UsageError | DatabaseUnavailable | EmbeddedServerError):
        return CliError(str(exc))
    return CliFailure(str(exc))


class CliFailure(CliError):
    """A failure that is not the user's: one line, exit code 1."""

    exit_code = 1


class PgqGroup(click.Group):
    """A click group that maps `PgqError` to `CliError` for every command below it."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a `PgqError` becomes one line on stderr and its exit code."""
        try:
            return super().invoke(ctx)
        except PgqError as exc:
            raise cli_error(exc) from None


# --- per-invocation state -----------------------------------------------------


@dataclass
class State:
    """What the group-level options decided; the engine and settings are made lazily."""

    dsn: str | None = None
    config: str | None = None
    schema: str | None = None
    _engine: Engine | None = field(default=None, repr=False)
    _settings: Settings | None = field(default=None, repr=False)

    @property
    def engine(self) -> Engine:
        """The engine for this invocation (created on first use, disposed on exit)."""
        if self._engine is None:
            self._engine = connect(cli_dsn(self.dsn), schema=self.schema)
        return self._engine

    @property
    def settings(self) -> Settings:
        """Settings from `--config`, then `PGQ_*` variables (loaded on first use)."""
        if self._settings is None:
            self._settings = load_settings(self.config)
        return self._settings

    def close(self) -> None:
        """Dispose of the engine, if one was made."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


pass_state = click.make_pass_decorator(State)


def cli_dsn(dsn: str | None) -> str | None:
    """`dsn` with a short `connect_timeout` added when it sets none (None stays None).

    A wrong host then fails in seconds, not after the OS's TCP timeout. Without a
    DSN `pgq.connect` falls back to the embedded server, which is local.
    """
    if not dsn:
        return None
    check_dsn(dsn)
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    if "connect_timeout" in params or os.environ.get("PGCONNECT_TIMEOUT"):
        return dsn
    return psycopg.conninfo.make_conninfo(dsn, connect_timeout=CONNECT_TIMEOUT)


# --- logging ------------------------------------------------------------------


class _StderrHandler(logging.StreamHandler[IO[str]]):
    """Writes to whatever `sys.stderr` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass


def configure_logging(verbose: int, level: str | None = None) -> None:
    """Send the `pgq` loggers to stderr: INFO by default, DEBUG with `-v`.

    Other libraries stay at the root logger's WARNING. Calling it again (tests
    invoke the CLI many times in one process) replaces the handler it installed.
    """
    logger = logging.getLogger("pgq")
    for handler in list(logger.handlers):
        if isinstance(handler, _StderrHandler):
            logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_LOG_FORMAT, _LOG_DATEFMT))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else (level or "INFO").upper())


# --- output -------------------------------------------------------------------


def emit(data: Any, as_json: bool, human: Callable[[Any], Iterable[str]]) -> None:
    """Print `data` as one JSON document, or as the lines `human(data)` renders."""
    if as_json:
        click.echo(json.dumps(data))
        return
    for line in human(data):
        click.echo(line)


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [list(headers), *cells]
    ]


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _members_lines(members: list[dict[str, Any]]) -> list[str]:
    if not members:
        return ["no members"]
    return _table(
        ("NAME", "LIVE", "LOCAL_BREAKER", "LAST_SEEN", "LEFT_AT"),
        (
            (m["name"], m["live"], m["local_breaker"], m["last_seen"], m.get("left_at"))
            for m in members
        ),
    )


def _holder_line(holder: dict[str, Any] | None) -> list[str]:
    # a publisher's transaction holds the frontier for milliseconds: not worth a line
    if not holder or holder["age_s"] < 1:
        return []
    return [
        f"frontier held by pid {holder['pid']}: transaction open {holder['age_s']:.0f}s,"
        f" {holder['state']}, database {holder['datname']}"
    ]


def _status_lines(s: dict[str, Any]) -> list[str]:
    c, tot, b = s["counts"], s["totals"], s["breaker"]
    live = sum(1 for m in s["members"] if m["live"])
    breaker = f"{b['state']} since {b['since']}, epoch {b['epoch']}"
    if b["prober"]:
        breaker += f", prober {b['prober']}"
    lines = [
        f"group {s['group']} on topic {s['topic']}",
        f"  committed  {_cell(s['committed'])}",
        f"  lag        {s['lag']}",
        f"  counts     ready {c['ready']}  leased {c['leased']}  done {c['done']}"
        f"  dead {c['dead']} (systemic {c['dead_systemic']})",
        f"  totals     reclaimed {tot['reclaimed']}  released {tot['released']}"
        f"  refunded {tot['refunded']}",
        f"  breaker    {breaker}",
        f"  members    {live} live of {len(s['members'])}",
    ]
    lines += ["    " + line for line in _members_lines(s["members"])] if s["members"] else []
    return lines + ["  " + line for line in _holder_line(s.get("frontier_held_by"))]


def _status_all_lines(data: dict[str, Any]) -> list[str]:
    groups = data["groups"]
    if not groups:
        return ["no groups"]
    lines = _table(
        (
            "GROUP",
            "TOPIC",
            "COMMITTED",
            "LAG",
            "READY",
            "LEASED",
            "DONE",
            "DEAD",
            "BREAKER",
            "LIVE",
        ),
        (
            (
                g["group"],
                g["topic"],
                g["committed"],
                g["lag"],
                g["counts"]["ready"],
                g["counts"]["leased"],
                g["counts"]["done"],
                g["counts"]["dead"],
                g["breaker"]["state"],
                sum(1 for m in g["members"] if m["live"]),
            )
            for g in groups
        ),
    )
    return lines + _holder_line(groups[0].get("frontier_held_by"))


def _breaker_lines(b: dict[str, Any]) -> list[str]:
    lines = [
        f"state   {b['state']}",
        f"since   {b['since']}",
        f"epoch   {b['epoch']}",
        f"prober  {_cell(b['prober'])}",
    ]
    if b.get("next_probe_at"):
        lines.append(f"next probe  {b['next_probe_at']}")
    if not b["history"]:
        return [*lines, "history: none"]
    history = _table(
        ("EPOCH", "STATE", "AT", "REFUNDED"),
        ((h["epoch"], h["state"], h["at"], h["refunded"]) for h in b["history"]),
    )
    return [*lines, "history:", *("  " + line for line in history)]


def _dead_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["no dead rows"]
    return _table(
        ("MESSAGE_ID", "CLASS", "ATTEMPTS", "RECLAIMS", "REFUNDS", "UPDATED_AT", "ERROR"),
        (
            (
                r["message_id"],
                r["error_class"],
                r["attempts"],
                r["reclaims"],
                r["refunds"],
                r["updated_at"],
                _one_line(r["error"]),
            )
            for r in rows
        ),
    )


def _one_line(text: str | None, width: int = 80) -> str | None:
    if text is None:
        return None
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


# --- JSON input ---------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str) -> Any:
    """Parse strict JSON (no NaN/Infinity); raises `ValueError` with a one-line reason."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise ValueError(f"{exc.msg} at {where}") from None


def parse_json_lines(lines: Iterable[bytes | str]) -> list[Any]:
    """One payload per non-blank line; a bad line raises `InvalidPayload` naming it.

    Bytes are decoded as UTF-8 (undecodable bytes make the line invalid).
    """
    payloads = []
    for number, line in enumerate(lines, start=1):
        try:
            text = line.decode() if isinstance(line, bytes) else line
            if not text.strip():
                continue
            payloads.append(parse_json(text))
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise InvalidPayload(f"line {number}: invalid JSON: {exc}") from None
    return payloads


# --- the commands -------------------------------------------------------------


@click.group(cls=PgqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--dsn",
    envvar="PGQ_DSN",
    metavar="DSN",
    help="libpq URL or key=value string [env PGQ_DSN; default: the embedded server]",
)
@click.option(
    "--config",
    envvar="PGQ_CONFIG",
    metavar="FILE",
    help="TOML configuration file [env PGQ_CONFIG]",
)
@click.option(
    "--schema", envvar="PGQ_SCHEMA", metavar="NAME", help="schema name [env PGQ_SCHEMA; pgq]"
)
@click.option("-v", "--verbose", count=True, help="debug logging on stderr")
@click.option(
    "--log-level",
    envvar="PGQ_LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="level of pgq's log lines on stderr [env PGQ_LOG_LEVEL; INFO]",
)
@click.version_option(package_name="pgq-breaker", prog_name="pgq")
@click.pass_context
def cli(
    ctx: click.Context,
    dsn: str | None,
    config: str | None,
    schema: str | None,
    verbose: int,
    log_level: str | None,
) -> None:
    """pgq: a PostgreSQL message queue whose consumer groups share a circuit breaker."""
    configure_logging(verbose, log_level)
    state = State(dsn=dsn or None, config=config or None, schema=schema or None)
    ctx.obj = state
    ctx.call_on_close(state.close)


@cli.command()
@pass_state
def init(state: State) -> None:
    """Create or upgrade the schema (safe to run concurrently)."""
    from pgq.migrations import migrate

    version = migrate(state.engine)
    click.echo(f"schema {schema_of(state.engine)} at version {version}")


@cli.group(cls=PgqGroup)
def topic() -> None:
    """Manage topics."""


@topic.command("create")
@click.argument("name")
@pass_state
def topic_create(state: State, name: str) -> None:
    """Create topic NAME (idempotent)."""
    from pgq.topics import create_topic

    create_topic(state.engine, name)
    click.echo(f"topic {name}")


@cli.command()
@click.argument("group")
@click.argument("topic")
@click.option(
    "--from",
    "start",
    type=click.Choice(["earliest", "latest"]),
    default="earliest",
    show_default=True,
    help="earliest: also every retained message; latest: only new ones",
)
@pass_state
def subscribe(state: State, group: str, topic: str, start: str) -> None:
    """Create consumer group GROUP on TOPIC (idempotent)."""
    from pgq.topics import subscribe as subscribe_group

    subscribe_group(state.engine, group, topic, start="latest" if start == "latest" else "earliest")
    click.echo(f"group {group} on topic {topic}")


@cli.command()
@click.argument("topic")
@click.argument("payload", metavar="[JSON]", required=False)
@click.option("--key", help="label carried with every message")
@pass_state
def publish(state: State, topic: str, payload: str | None, key: str | None) -> None:
    """Publish one JSON message, or JSON lines from stdin (JSON `-` or absent).

    All of stdin is one transaction: one bad line and nothing is published.
    Prints the new ids, one per line.
    """
    from pgq.topics import check_name, publish_many

    check_name("topic", topic)
    if payload is None or payload == "-":
        payloads = parse_json_lines(sys.stdin.buffer)
    else:
        try:
            payloads = [parse_json(payload)]
        except ValueError as exc:
            raise InvalidPayload(f"invalid JSON: {exc}") from None
    for mid in publish_many(state.engine, topic, payloads, key=key):
        click.echo(str(mid))


@cli.command()
@click.argument("group", required=False)
@click.option("--json", "as_json", is_flag=True, help="print the contract JSON object")
@pass_state
def status(state: State, group: str | None, as_json: bool) -> None:
    """Frontier, counts, lag, breaker and members of GROUP (or of every group)."""
    ttl = state.settings.breaker_member_ttl
    if group is None:
        emit(st.status_all(state.engine, member_ttl=ttl), as_json, _status_all_lines)
    else:
        emit(st.status(state.engine, group, member_ttl=ttl), as_json, _status_lines)


@cli.command()
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list")
@pass_state
def members(state: State, group: str, as_json: bool) -> None:
    """Live and stale members of GROUP with their local breaker states."""
    ttl = state.settings.breaker_member_ttl
    emit(st.members(state.engine, group, ttl), as_json, _members_lines)


@cli.command()
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object")
@click.option(
    "--limit", default=st.DEFAULT_HISTORY_LIMIT, show_default=True, type=click.IntRange(0)
)
@pass_state
def breaker(state: State, group: str, as_json: bool, limit: int) -> None:
    """GROUP's global breaker: state, since when, prober and history."""
    emit(st.breaker_info(state.engine, group, history_limit=limit), as_json, _breaker_lines)


@cli.command()
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(0))
@pass_state
def dead(state: State, group: str, as_json: bool, limit: int) -> None:
    """Dead rows of GROUP with their error class, error and counts."""
    emit(st.dead(state.engine, group, limit), as_json, _dead_lines)


@cli.group(cls=PgqGroup)
def server() -> None:
    """The embedded PostgreSQL server under $PGQ_HOME."""


@server.command("status")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object")
def server_status(as_json: bool) -> None:
    """Is the embedded server running (exit 0 either way)."""
    from pgq import embedded

    s = embedded.status()
    data = {
        "running": s.running,
        "pid": s.pid,
        "dsn": s.dsn,
        "data_dir": str(s.data_dir),
    }

    def human(d: dict[str, Any]) -> list[str]:
        if not d["running"]:
            what = f"not ready, pid {d['pid']}" if d["pid"] else "not running"
            return [f"{what} (data in {d['data_dir']})"]
        return [f"running, pid {d['pid']}", f"dsn   {d['dsn']}", f"data  {d['data_dir']}"]

    emit(data, as_json, human)


@server.command("stop")
@click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(0))
def server_stop(timeout: float) -> None:
    """Stop the embedded server (nothing to do when it is not running)."""
    from pgq import embedded

    click.echo("stopped" if embedded.stop(timeout=timeout) else "not running")


def _register_commands() -> None:
    """Commands that live in their own modules (they import this one)."""
    from pgq.cli_admin import check, requeue_command
    from pgq.cli_consume import consume
    from pgq.cli_demo import demo

    cli.add_command(consume)
    cli.add_command(check)
    cli.add_command(requeue_command)
    cli.add_command(demo)


_register_commands()


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="pgq")


if __name__ == "__main__":
    main()
