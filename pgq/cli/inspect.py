"""Looking at a group: `pgq status`, `pgq members`, `pgq breaker`, `pgq dead`, `pgq check`.

Each command reads through one `pgq.monitor` function and prints its result
with `--json` as is (a read model as its `to_json()`), or as the lines
`pgq.cli.render` makes of the same data (their times relative to the
database's clock, read for them).

`status` and `members` list the live members and those that departed in the
last `monitor.RECENTLY_DEPARTED` seconds; `--all` lists every member row
(departed ones are forgotten after `breaker.member_retention`).

`pgq check GROUP` prints one line on stdout starting with its state word and
exits with the Nagios code: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. Every error
of the check itself (bad usage, bad DSN, unreachable server, missing schema,
unknown group) is `UNKNOWN: ...` with exit 3: the CLI's exit-2 rule does not
apply here, a monitoring system must always get an answer it understands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from pgq import monitor
from pgq.cli.base import CheckCommand, State, emit, json_option, pass_state
from pgq.cli.parse import parse_max_age
from pgq.cli.render import (
    breaker_lines,
    dead_lines,
    members_lines,
    status_all_lines,
    status_lines,
    visible,
)
from pgq.errors import PgqError
from pgq.store import database_now, first_line

__all__ = ["breaker", "check", "dead", "members", "status"]


def _now_of(state: State, render: Callable[..., list[str]]) -> Callable[[Any], list[str]]:
    """`render` with `now=` the database's clock, read only when it is called."""
    return lambda data: render(data, now=database_now(state.engine))


_all_option = click.option(
    "--all",
    "every",
    is_flag=True,
    help="every member, also those that departed more than"
    f" {monitor.RECENTLY_DEPARTED / 60:g} minutes ago",
)


@click.command()
@click.argument("group", required=False)
@json_option("the contract JSON object")
@_all_option
@pass_state
def status(state: State, group: str | None, as_json: bool, every: bool) -> None:
    """Frontier, counts, lag, breaker and members of GROUP (or of every group)."""
    ttl = state.settings.breaker_member_ttl
    recent = None if every else monitor.RECENTLY_DEPARTED
    if group is None:
        every_group = monitor.read_status_all(state.engine, member_ttl=ttl, departed_within=recent)
        emit(every_group, as_json, status_all_lines)
    else:
        one = monitor.read_status(state.engine, group, member_ttl=ttl, departed_within=recent)
        emit(one, as_json, _now_of(state, status_lines))


@click.command()
@click.argument("group")
@json_option("a JSON list")
@_all_option
@pass_state
def members(state: State, group: str, as_json: bool, every: bool) -> None:
    """Live and recently departed members of GROUP with their local breaker states."""
    ttl = state.settings.breaker_member_ttl
    recent = None if every else monitor.RECENTLY_DEPARTED
    data = monitor.read_members(state.engine, group, ttl, departed_within=recent)
    emit(data, as_json, _now_of(state, members_lines))


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
    emit(info, as_json, _now_of(state, breaker_lines))


@click.command()
@click.argument("group")
@json_option("a JSON list")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(0))
@pass_state
def dead(state: State, group: str, as_json: bool, limit: int) -> None:
    """Dead rows of GROUP with their error class, error and counts."""
    emit(monitor.dead(state.engine, group, limit), as_json, _now_of(state, dead_lines))


@click.command(cls=CheckCommand)
@click.argument("group")
@click.option(
    "--max-age",
    default="15m,1h",
    show_default=True,
    metavar="WARN[,CRIT]",
    help="WARNING (CRITICAL) when the oldest row ready now has been claimable longer",
)
@pass_state
def check(state: State, group: str, max_age: str) -> None:
    """One line for monitoring, Nagios style: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.

    While the group breaker is OPEN its dead systemic rows are pending
    reconciliation (WARNING); dead rows of other classes, and systemic rows
    past the refund cap or owed no refund, are CRITICAL. A row ready now that
    has waited longer than --max-age WARN (CRIT) is WARNING (CRITICAL): no live
    member, or none that claims. The worst state wins.
    """
    try:
        word, line = monitor.check(
            state.engine,
            group,
            state.settings.breaker_max_refunds,
            max_age=parse_max_age(max_age),
            member_ttl=state.settings.breaker_member_ttl,
        )
    except PgqError as exc:
        word, line = "UNKNOWN", f"UNKNOWN: {first_line(exc)}"
    except Exception as exc:  # a check answers UNKNOWN, never with a traceback
        word, line = "UNKNOWN", f"UNKNOWN: {type(exc).__name__}: {first_line(exc)}"
    click.echo(visible(line))
    raise click.exceptions.Exit(monitor.CHECK_EXIT_CODES[word])
