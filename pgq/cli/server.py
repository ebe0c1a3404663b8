"""The embedded server under `$PGQ_HOME`: `pgq server status`, `pgq server stop`."""

from __future__ import annotations

import click

from pgq import embedded
from pgq.cli.base import PgqGroup, emit, json_option
from pgq.cli.render import server_status_lines

__all__ = ["server"]


@click.group(cls=PgqGroup)
def server() -> None:
    """The embedded PostgreSQL server under $PGQ_HOME."""


@server.command("status")
@json_option("a JSON object")
def server_status(as_json: bool) -> None:
    """Is the embedded server running (exit 0 either way)."""
    s = embedded.status()
    data = {"running": s.running, "pid": s.pid, "dsn": s.dsn, "data_dir": str(s.data_dir)}
    emit(data, as_json, server_status_lines)


@server.command("stop")
@click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(0))
def server_stop(timeout: float) -> None:
    """Stop the embedded server (nothing to do when it is not running)."""
    click.echo("stopped" if embedded.stop(timeout=timeout) else "not running")
