"""The base every `pgq` command stands on: the root group, state, errors, shared options.

- `cli`: the root click group with the global options (`--dsn`, `--config`,
  `--schema`, `-v`, `--log-level`); it holds no commands itself, `pgq.cli`
  adds them (the only place that imports the command modules);
- `PgqGroup`: every user-facing `PgqError` below it becomes one line on stderr
  (`pgq: error: ...`) and exit 2 (`CliError`); anything else pgq raised is one
  line and exit 1 (`CliFailure`); never a traceback;
- `CheckCommand` / `CheckUnknown`: `pgq check` answers `UNKNOWN: ...` with exit 3
  for every error of its own, usage errors included (Nagios needs an answer);
- `State` / `pass_state`: what the global options decided, with the engine and
  the settings made on first use;
- `cli_dsn`: a DSN with a short connect timeout; `configure_logging` (from
  `pgq.cli.logs`): the only place that installs logging handlers, text or JSON
  lines (`--log-format`); `json_option` and `emit`: `--json` and
  human output from the same data (the human lines come from `pgq.cli.render`).

Adding a command: write it in the module of its family with `@click.command()`,
take `state: State` through `@pass_state`, call the library through
`state.engine` / `state.settings`, print with `emit`, and register it in
`pgq/cli/__init__.py`. Errors need no handling in the command.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import IO, Any, TypeVar

import click
from sqlalchemy import Engine

from pgq.cli import startup
from pgq.cli.logs import FORMATS, configure_logging, report, use_format
from pgq.errors import (
    DatabaseUnavailable,
    EmbeddedServerError,
    PgqError,
    UsageError,
    install_extra,
)
from pgq.monitor import CHECK_EXIT_CODES
from pgq.read_models import json_default
from pgq.settings import Settings, load_settings
from pgq.store import connect, has_password, with_connect_timeout

__all__ = [
    "CONNECT_TIMEOUT",
    "EXIT_USAGE",
    "LOG_FIELDS",
    "CheckCommand",
    "CheckUnknown",
    "CliError",
    "CliFailure",
    "PgqGroup",
    "State",
    "bind_dashboard",
    "cli",
    "cli_dsn",
    "cli_error",
    "configure_logging",
    "emit",
    "json_option",
    "pass_state",
    "stopping_on_signals",
    "web_extra",
]

F = TypeVar("F", bound=Callable[..., Any])

CONNECT_TIMEOUT = 5
"""Seconds a CLI command waits for the server before it gives up (unless the DSN says)."""

EXIT_USAGE = 2
"""Bad usage, bad configuration, or a database that cannot be used (DESIGN §7)."""


# --- errors -------------------------------------------------------------------


class CliError(click.ClickException):
    """A failure shown as one line, `pgq: error: <message>`, with its exit code.

    With `--log-format json` the line is a JSON object (`level` ERROR, `message`
    and `error` the message, `exit_code`, and the fields of the command it
    stopped: `group=`, `LOG_FIELDS`)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()) or "error")
        self.fields: dict[str, Any] = {}

    def show(self, file: IO[Any] | None = None) -> None:
        """Write the one line to stderr."""
        if file is not None:
            click.echo(f"pgq: error: {self.format_message()}", file=file)
            return
        text = self.format_message()
        report(
            f"pgq: error: {text}",
            text,
            level="ERROR",
            error=text,
            exit_code=self.exit_code,
            **self.fields,
        )


class CliFailure(CliError):
    """A failure that is not the user's: one line, exit code 1."""

    exit_code = 1


def cli_error(exc: PgqError) -> CliError:
    """Exit 2 for user errors and an unusable database, 1 for anything else pgq raised."""
    if isinstance(exc, UsageError | DatabaseUnavailable | EmbeddedServerError):
        return CliError(str(exc))
    return CliFailure(str(exc))


_HELP_ASKED: tuple[type[Exception], ...] = tuple(
    getattr(click.exceptions, name)
    for name in ("NoArgsIsHelpError",)
    if hasattr(click.exceptions, name)
)
"""click (8.2+) shows a group's help as a usage error when no command is given."""


def usage_error(exc: click.UsageError) -> click.ClickException:
    """click's usage error (usage, hint, blank line, error) as pgq's one line; a
    group called without a command still shows its help."""
    if isinstance(exc, _HELP_ASKED):
        return exc
    hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    return CliError(exc.format_message() + hint)


class PgqGroup(click.Group):
    """A click group that maps `PgqError` to `CliError` for every command below it,
    and click's usage errors to the same one line."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        use_format("text")  # until the options say (an earlier invocation chose json)
        try:
            rest = super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise usage_error(exc) from None
        use_format(ctx.params.get("log_format") or "text")
        return rest

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a `PgqError` or a usage error becomes one line on stderr
        and its exit code."""
        try:
            return super().invoke(ctx)
        except PgqError as exc:
            raise _with_fields(cli_error(exc), ctx) from None
        except click.UsageError as exc:
            raise _with_fields(usage_error(exc), ctx) from None
        except CliError as exc:
            raise _with_fields(exc, ctx) from None


LOG_FIELDS = "pgq.log_fields"
"""The key in `click.Context.meta` under which a command names what it works on
(`{"group": ...}`, set by `pass_state`): its error line carries them with
`--log-format json`."""


def _with_fields(exc: click.ClickException, ctx: click.Context) -> click.ClickException:
    if isinstance(exc, CliError):
        exc.fields = {**ctx.meta.get(LOG_FIELDS, {}), **exc.fields}
    return exc


class CheckUnknown(click.ClickException):
    """`pgq check` could not decide: `UNKNOWN: <reason>` on stdout, exit 3."""

    exit_code = CHECK_EXIT_CODES["UNKNOWN"]

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()) or "unknown error")

    def show(self, file: IO[Any] | None = None) -> None:
        """Write the one line to stdout (where Nagios reads it)."""
        click.echo(f"UNKNOWN: {self.format_message()}", file=file)


class CheckCommand(click.Command):
    """A command whose usage errors are `UNKNOWN` (exit 3), not click's exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise CheckUnknown(f"usage: {exc.format_message()}") from None


# --- per-invocation state -----------------------------------------------------


@dataclass
class State:
    """What the group-level options decided; the engine and settings are made lazily."""

    dsn: str | None = None
    session_dsn: str | None = None
    config: str | None = None
    schema: str | None = None
    _engine: Engine | None = field(default=None, repr=False)
    _settings: Settings | None = field(default=None, repr=False)

    @property
    def engine(self) -> Engine:
        """The engine for this invocation (created on first use, disposed on exit)."""
        if self._engine is None:
            self._engine = connect(
                cli_dsn(self.dsn), schema=self.schema, session_dsn=cli_dsn(self.session_dsn)
            )
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


_pass_state = click.make_pass_decorator(State)


def pass_state(command: F) -> F:
    """Pass the invocation's `State` as the first argument; a command's `group`
    (or `topic`) argument is also what its error line names (`LOG_FIELDS`)."""

    @functools.wraps(command)
    def named(*args: Any, **kwargs: Any) -> Any:
        fields = {k: kwargs[k] for k in ("group", "topic") if isinstance(kwargs.get(k), str)}
        if fields:
            click.get_current_context().meta[LOG_FIELDS] = fields
        return command(*args, **kwargs)

    return _pass_state(named)  # type: ignore[return-value]


def cli_dsn(dsn: str | None) -> str | None:
    """`dsn` with a short `connect_timeout` added when it sets none (None stays None).

    A wrong host then fails in seconds, not after the OS's TCP timeout. Without a
    DSN `pgq.connect` falls back to the embedded server, which is local.
    """
    if not dsn:
        return None
    return with_connect_timeout(dsn, CONNECT_TIMEOUT)


# --- output -------------------------------------------------------------------


def json_option(what: str) -> Callable[[F], F]:
    """The `--json` flag (passed as `as_json`); `what` says what it prints."""
    return click.option("--json", "as_json", is_flag=True, help=f"print {what}")


def emit(data: Any, as_json: bool, human: Callable[[Any], Iterable[str]]) -> None:
    """Print `data` as one JSON document, or as the lines `human(data)` renders. A read
    model in `data` (`pgq.read_models`) prints as its `to_json()`."""
    if as_json:
        click.echo(json.dumps(data, default=json_default))
        return
    for line in human(data):
        click.echo(line)


# --- the root group -----------------------------------------------------------


@click.group(cls=PgqGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--dsn",
    envvar="PGQ_DSN",
    metavar="DSN",
    help="libpq URL or key=value string [env PGQ_DSN; default: the embedded server]",
)
@click.option(
    "--session-dsn",
    envvar="PGQ_SESSION_DSN",
    metavar="DSN",
    help="where a consumer's session connection goes (liveness and probe locks, LISTEN)"
    " when --dsn is a pooler in transaction mode [env PGQ_SESSION_DSN; default: --dsn]",
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
@click.option(
    "--log-format",
    envvar="PGQ_LOG_FORMAT",
    type=click.Choice(FORMATS, case_sensitive=False),
    default="text",
    help="log lines as key=value text or JSON objects [env PGQ_LOG_FORMAT; text]",
)
@click.version_option(package_name="pgq-breaker", prog_name="pgq")
@click.pass_context
def cli(
    ctx: click.Context,
    dsn: str | None,
    session_dsn: str | None,
    config: str | None,
    schema: str | None,
    verbose: int,
    log_level: str | None,
    log_format: str,
) -> None:
    """pgq: a PostgreSQL message queue whose consumer groups share a circuit breaker."""
    startup.command_began()
    configure_logging(verbose, log_level, log_format.lower())
    warn_visible_password(ctx, "dsn", "session_dsn")
    state = State(
        dsn=dsn or None,
        session_dsn=session_dsn or None,
        config=config or None,
        schema=schema or None,
    )
    ctx.obj = state
    ctx.call_on_close(state.close)


def warn_visible_password(ctx: click.Context, *names: str) -> None:
    """One warning when a DSN given as a flag (not its environment variable) holds a
    password: every user of the machine can read a command line (`ps`), and Python
    cannot hide its own (decision 0036)."""
    flags = [
        "--" + name.replace("_", "-")
        for name in names
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
        and has_password(ctx.params.get(name) or "")
    ]
    if flags:
        logging.getLogger("pgq.cli").warning(
            "password on the command line flag=%s: every user of this machine can read it"
            " (ps); give the DSN in PGQ_DSN, the password in PGPASSWORD, ~/.pgpass or a"
            " service file",
            ",".join(flags),
        )


def web_extra() -> ModuleType:
    """`pgq.web`, or a `UsageError` saying how to install the `web` extra it needs."""
    try:
        return importlib.import_module("pgq.web")
    except ImportError as exc:
        raise UsageError(
            f"the dashboard needs the web extra ({exc.name} is missing): " + install_extra("web")
        ) from None


def bind_dashboard(engine: Engine, host: str, port: int, **options: Any) -> Any:
    """A bound `pgq.web.WebServer` (see `pgq.web.dashboard_server`); a port that cannot
    be had is a `UsageError`."""
    web = web_extra()
    try:
        return web.dashboard_server(engine, host=host, port=port, **options)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except ValueError:  # waitress: the address does not resolve
        raise UsageError(f"cannot listen on {host!r}: not an address of this machine") from None


STOP_SIGNALS = startup.STOP_SIGNALS


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGINT raise KeyboardInterrupt in the main thread (as Ctrl-C
    does by default; not `startup.Stopped`), so that the same clean stop runs (a
    service manager stops with SIGTERM; its default action killed `pgq web`
    mid-request and left `pgq demo --web`'s scratch schema behind;
    tests/integration/test_web_attacks.py). A second one acts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
