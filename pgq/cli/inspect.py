"""Looking at a group: `pgq status`, `pgq members`, `pgq breaker`, `pgq dead`, `pgq check`.

Each command reads through one `pgq.monitor` function and prints its result
with `--json` as is, or as the lines `pgq.cli.render` makes of the same data.

`pgq check GROUP` prints one line on stdout starting with its state word and
exits with the Nagios code: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. Every error
of the check itself (bad usage, bad DSN, unreachable server, missing schema,
unknown group) is `UNKNOWN: ...` with exit 3: the CLI's exit-2 rule does not
apply here, a monitoring system must always get an answer it understands.
"""

from __future__ import annotations

import click

from pgq import monitor
from pgq.cli.base import CheckCommand, State, emit, json_option, pass_state
from pgq.cli.render import (
    breaker_lines,
    dead_lines,
    members_lines,
    status_all_lines,
    status_lines,
    visible,
)
from pgq.errors import PgqError
from pgq.store import first_line

__all__ = ["breaker", "check", "dead", "members", "status"]


@click.command()
@click.argument("group", required=False)
@json_option("the contract JSON object")
@pass_state
def status(state: State, group: str | None, as_json: bool) -> None:
    """Frontier, counts, lag, breaker and members of GROUP (or of every group)."""
    ttl = state.settings.breaker_member_ttl
    if group is None:
        emit(monitor.status_all(state.engine, member_ttl=ttl), as_json, status_all_lines)
    else:
        emit(monitor.status(state.engine, group, member_ttl=ttl), as_json, status_lines)


@click.command()
@click.argument("group")
@json_option("a JSON list")
@pass_state
def members(state: State, group: str, as_json: bool) -> None:
    """Live and stale members of GROUP with their local breaker states."""
    ttl = state.settings.breaker_member_ttl
    emit(monitor.members(state.engine, group, ttl), as_json, members_lines)


@click.command()
@click.argument("group")
@json_option("a JSON object")
@click.option(
    "--limit", default=monitor.DEFAULT_HISTORY_LIMIT, show_default=True, type=click.IntRange(0)
)
@pass_state
def breaker(state: State, group: str, as_json: bool, limit: int) -> None:
    """GROUP's global breaker: state, since when, prober and history."""
    info = monitor.breaker_info(state.engine, group, history_limit=limit)
    emit(info, as_json, breaker_lines)


@click.command()
@click.argument("group")
@json_option("a JSON list")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(0))
@pass_state
def dead(state: State, group: str, as_json: bool, limit: int) -> None:
    """Dead rows of GROUP with their error class, error and counts."""
    emit(monitor.dead(state.engine, group, limit), as_json, dead_lines)


@click.command(cls=CheckCommand)
@click.argument("group")
@pass_state
def check(state: State, group: str) -> None:
    """One line for monitoring, Nagios style: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.

    While the group breaker is OPEN its dead systemic rows are pending
    reconciliation (WARNING); dead rows of other classes, and systemic rows
    past the refund cap or owed no refund, are CRITICAL. The worst state wins.
    """
    try:
        word, line = monitor.check(state.engine, group, state.settings.breaker_max_refunds)
    except PgqError as exc:
        word, line = "UNKNOWN", f"UNKNOWN: {first_line(exc)}"
    except Exception as exc:  # a check answers UNKNOWN, never with a traceback
        word, line = "UNKNOWN", f"UNKNOWN: {type(exc).__name__}: {first_line(exc)}"
    click.echo(visible(line))
    raise click.exceptions.Exit(monitor.CHECK_EXIT_CODES[word])
