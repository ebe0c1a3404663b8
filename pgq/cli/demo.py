"""`pgq demo`: the breaker story on the embedded server (or `--dsn`), in under a minute.

A thin command over `pgq.demo.run_demo`, which tells the story through the
output callable it is given: here `click.echo`, so the narration is this
command's stdout. It quiets pgq's own log lines to ERROR while the demo runs
(unless `-v` asked for DEBUG), so that the narration is what you read; the
events those lines would report are in the narration.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import click
from sqlalchemy import Engine

from pgq.cli.base import (
    CliFailure,
    State,
    bind_dashboard,
    cli_dsn,
    pass_state,
    stopping_on_signals,
    web_extra,
)
from pgq.demo import DEMO_SETTINGS, GROUP, RATE, WATCHED, run_demo
from pgq.errors import UsageError
from pgq.store import conninfo_of

__all__ = ["demo"]


@contextlib.contextmanager
def _quiet_library() -> Iterator[None]:
    """Raise the `pgq` logger to ERROR for the duration (DEBUG stays DEBUG)."""
    logger = logging.getLogger("pgq")
    level = logger.level
    if logger.getEffectiveLevel() > logging.DEBUG:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Dashboard:
    """`pgq demo --web`: the dashboard on the demo's group while the story runs, and
    after it until Ctrl-C (the scratch schema is dropped only then)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stopped = threading.Event()

    @contextlib.contextmanager
    def __call__(self, engine: Engine) -> Iterator[None]:
        web = web_extra()
        options = web.WebOptions(
            member_ttl=DEMO_SETTINGS["breaker_member_ttl"],
            refresh=1.0,
            sample_every=2.0,
            group=GROUP,
        )
        server = bind_dashboard(engine, "127.0.0.1", self.port, options=options)
        server.start()
        click.echo(f"dashboard: {server.url}groups/{GROUP} (open it now: the story starts)")
        try:
            yield
            where = f"{server.url}groups/{GROUP}"
            click.echo(f"the dashboard stays up at {where}; Ctrl-C ends the demo")
            try:
                self.stopped.wait()
            except KeyboardInterrupt:
                click.echo("")
        finally:
            server.close()


def _port_free(port: int) -> None:
    """A `UsageError` now when `port` cannot be had, before the story starts (the
    dashboard binds it only once the demo's schema exists; docs/defects.md)."""
    if port == 0:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UsageError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}") from None


@click.command()
@click.option(
    "--dsn",
    metavar="DSN",
    help="run on this server instead (default: the global --dsn, $PGQ_DSN, else embedded)",
)
@click.option(
    "--web",
    is_flag=True,
    help="watch it on the dashboard (the web extra), at a slower pace; stays up until Ctrl-C",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="the dashboard's port with --web (0: any free)",
)
@pass_state
def demo(state: State, dsn: str | None, web: bool, port: int) -> None:
    """The whole breaker story, live: outage, open, probe, close, refund.

    Three members consume a stream of orders; the demo cuts their dependency,
    the group opens and one prober probes; the dependency comes back, the group
    closes and the outage's failed rows are refunded. Runs in a scratch schema
    that is dropped at the end. Exits 0 when all of that happened, 1 otherwise.
    With --web the dashboard shows it live on 127.0.0.1:PORT.
    """
    target = (cli_dsn(dsn) if dsn else None) or conninfo_of(state.engine)
    watch = _Dashboard(port) if web else None
    if web:
        web_extra()  # before the story: a missing extra is exit 2 at once
        _port_free(port)  # and so is a taken port
    pace = WATCHED if web else None
    messages = int(RATE * (WATCHED.cut_after + WATCHED.outage + 8)) if web else 600
    with _quiet_library(), stopping_on_signals():
        result = run_demo(target, click.echo, messages=messages, pace=pace, watch=watch)
    if not result.ok:
        raise CliFailure(f"demo failed: {result.problem}")
    click.echo("demo ok: the group opened, probed, closed and refunded the outage's rows")
