"""Repairing and auditing a group: `pgq requeue`, `pgq purge`, `pgq show`, `pgq audit`.

`pgq requeue GROUP (--id ID ... | --all [--class C]) --reason TEXT` turns dead
rows back to ready and `pgq purge GROUP --dead [--older-than D] --reason TEXT`
deletes them; each writes one `audit` row in the same statement as its change.
`pgq show GROUP ID` prints one message in full, `pgq audit GROUP` the audit
trail. `pgq.store.requeue()` / `pgq.store.purge()` and `pgq.monitor.message()`
/ `pgq.monitor.audit()` are the plain functions behind them, for scripts.

Human output escapes every character that is not printable (`render.visible`):
payloads, error texts, reasons and names come from users and handlers.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import click

from pgq import monitor
from pgq.cli.base import State, emit, json_option, pass_state
from pgq.cli.parse import parse_age, parse_ids, parse_message_id
from pgq.cli.render import ago, message_lines, one_line, table
from pgq.errors import UsageError
from pgq.schema import ERROR_CLASSES
from pgq.store import database_now, purge, requeue
from pgq.store.admin import MAX_AUDIT_LIMIT

__all__ = [
    "audit_command",
    "audit_lines",
    "purge_command",
    "requeue_command",
    "show_command",
]


def _reason_given(reason: str | None) -> str:
    if not (reason or "").strip():
        raise UsageError("--reason is required and must not be empty")
    return reason or ""


@click.command("requeue")
@click.argument("group")
@click.option(
    "--id",
    "ids",
    multiple=True,
    metavar="ID",
    help="a dead message id to requeue (repeat, or comma-separated)",
)
@click.option("--all", "all_dead", is_flag=True, help="requeue every dead row of the group")
@click.option(
    "--class",
    "error_class",
    type=click.Choice(ERROR_CLASSES),
    help="with --all: only the dead rows of this error class",
)
@click.option("--reason", help="why (required; stored in the audit row)")
@pass_state
def requeue_command(
    state: State,
    group: str,
    ids: tuple[str, ...],
    all_dead: bool,
    error_class: str | None,
    reason: str | None,
) -> None:
    """Requeue dead rows of GROUP (audited): `--id ID ...` or `--all [--class C]`,
    with `--reason`.

    Every id must be a dead row of the group, else nothing is requeued (exit 2).
    Prints `requeued N`.
    """
    if ids and all_dead:
        raise UsageError("--id and --all are mutually exclusive")
    if not ids and not all_dead:
        raise UsageError("give the rows to requeue: --id ID ... or --all")
    if error_class and not all_dead:
        raise UsageError("--class goes with --all (it selects among all dead rows)")
    why = _reason_given(reason)
    result = requeue(
        state.engine,
        group,
        parse_ids(ids) if ids else None,
        all_dead=all_dead,
        error_class=error_class,
        reason=why,
    )
    click.echo(f"requeued {result.count}")


@click.command("purge")
@click.argument("group")
@click.option(
    "--dead",
    "dead_rows",
    is_flag=True,
    help="delete dead rows (required: the only rows purge deletes)",
)
@click.option(
    "--older-than",
    metavar="D",
    help="only rows dead for longer than D (seconds, or 7d, 12h, 30m, 90s; database clock)",
)
@click.option("--reason", help="why (required; stored in the audit row)")
@pass_state
def purge_command(
    state: State, group: str, dead_rows: bool, older_than: str | None, reason: str | None
) -> None:
    """Delete dead rows of GROUP (audited), with `--dead` and `--reason`.

    Dead rows that the group's owed or coming reconciliation will refund (the
    rows `pgq check` calls pending) are kept. Prints `purged N`, and how many
    were kept.
    """
    if not dead_rows:
        raise UsageError("give --dead: purge deletes dead rows only")
    why = _reason_given(reason)
    age = parse_age(older_than) if older_than is not None else None
    result = purge(
        state.engine,
        group,
        older_than=age,
        reason=why,
        max_refunds=state.settings.breaker_max_refunds,
    )
    kept = f", kept {result.kept} pending reconciliation" if result.kept else ""
    click.echo(f"purged {result.count}{kept}")


@click.command("show")
@click.argument("group")
@click.argument("message_id", metavar="ID")
@json_option("a JSON object")
@pass_state
def show_command(state: State, group: str, message_id: str, as_json: bool) -> None:
    """One message of GROUP in full: payload, headers, state, counters, error, lease.

    A done row the frontier already pruned shows as done with what is left; an
    id the group never had exits 2.
    """
    info = monitor.message(state.engine, group, parse_message_id(message_id))
    emit(info, as_json, message_lines)


_SHOWN_IDS = 5


def _listed(listed: Any, count: int) -> str:
    """An audit row's `message_ids` in a cell: the first few ids and how many more,
    or, for whatever else the row holds (any JSON a role that may insert audit rows
    wrote), that JSON cut short."""
    if isinstance(listed, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in listed[:_SHOWN_IDS]
    ):
        shown = ",".join(str(i) for i in listed[:_SHOWN_IDS])
        more = max(count, len(listed)) - min(len(listed), _SHOWN_IDS)
        return f"{shown} (+{more})" if more > 0 else shown or "-"
    if listed is None:
        return "-"
    return one_line(json.dumps(listed)[:_SHOWN_JSON], _SHOWN_JSON) or "-"


_SHOWN_JSON = 40


def audit_lines(rows: list[dict[str, Any]], *, now: dt.datetime) -> list[str]:
    """`pgq audit GROUP`: one row per audit entry, newest first, its time relative to
    `now`."""
    if not rows:
        return ["no audit rows"]
    return table(
        ("ID", "AT", "ACTION", "COUNT", "ACTOR", "ROLE", "MESSAGE_IDS", "REASON"),
        (
            (
                r["id"],
                ago(r["at"], now),
                r["action"],
                r["count"],
                r["actor"],
                r["role"],
                "?" if r["unreadable"] else _listed(r["message_ids"], r["count"]),
                one_line(r["reason"]),
            )
            for r in rows
        ),
    )


@click.command("audit")
@click.argument("group", required=False)
@click.option(
    "--topic", metavar="NAME", help="instead of a group: every row about topic NAME and its groups"
)
@json_option("a JSON list")
@click.option(
    "--limit",
    default=monitor.DEFAULT_AUDIT_LIMIT,
    show_default=True,
    type=click.IntRange(0, MAX_AUDIT_LIMIT),
)
@pass_state
def audit_command(
    state: State, group: str | None, topic: str | None, as_json: bool, limit: int
) -> None:
    """The audit trail of GROUP (or `--topic NAME`), newest first: who requeued,
    purged, unsubscribed or deleted what, when, why (also for a group or a topic
    that was removed since)."""
    if (group is None) == (topic is None):
        raise UsageError("give a GROUP or --topic NAME (not both)")
    rows = monitor.audit(state.engine, group, limit, topic=topic)
    emit(rows, as_json, lambda data: audit_lines(data, now=database_now(state.engine)))
