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
from collections.abc import Iterator

import click

from pgq.cli.base import CliFailure, State, cli_dsn, pass_state
from pgq.demo import run_demo
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


@click.command()
@click.option(
    "--dsn",
    metavar="DSN",
    help="run on this server instead (default: the global --dsn, $PGQ_DSN, else embedded)",
)
@pass_state
def demo(state: State, dsn: str | None) -> None:
    """The whole breaker story, live: outage, open, probe, close, refund.

    Three members consume a stream of orders; the demo cuts their dependency,
    the group opens and one prober probes; the dependency comes back, the group
    closes and the outage's failed rows are refunded. Runs in a scratch schema
    that is dropped at the end. Exits 0 when all of that happened, 1 otherwise.
    """
    target = (cli_dsn(dsn) if dsn else None) or conninfo_of(state.engine)
    with _quiet_library():
        result = run_demo(target, click.echo)
    if not result.ok:
        raise CliFailure(f"demo failed: {result.problem}")
    click.echo("demo ok: the group opened, probed, closed and refunded the outage's rows")
