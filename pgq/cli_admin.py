"""Admin commands: `pgq check` (Nagios) and `pgq requeue` (audited requeue of dead rows).

`pgq check GROUP` prints one line on stdout starting with its state word and
exits with the Nagios code: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. Every error
of the check itself (bad usage, bad DSN, unreachable server, missing schema,
unknown group) is `UNKNOWN: ...` with exit 3: the CLI's exit-2 rule does not
apply here, a monitoring system must always get an answer it understands.

`pgq requeue GROUP (--id ID ... | --all) --reason TEXT` turns dead rows back to
ready and writes one `audit` row, in one transaction. `pgq.admin.requeue()`
is the plain function behind it, for scripts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

import click

from pgq.admin import requeue
from pgq.cli import State, pass_state
from pgq.connect import first_line
from pgq.errors import PgqError, UsageError
from pgq.monitor import CHECK_EXIT_CODES
from pgq.monitor import check as check_group

# --- pgq check ------------------------------------------------------------------


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
        word, line = check_group(state.engine, group, state.settings.breaker_max_refunds)
    except PgqError as exc:
        word, line = "UNKNOWN", f"UNKNOWN: {first_line(exc)}"
    except Exception as exc:  # a check answers UNKNOWN, never with a traceback
        word, line = "UNKNOWN", f"UNKNOWN: {type(exc).__name__}: {first_line(exc)}"
    click.echo(line)
    raise click.exceptions.Exit(CHECK_EXIT_CODES[word])


# --- pgq requeue ----------------------------------------------------------------


def parse_ids(values: Iterable[str]) -> list[int]:
    """Message ids from `--id` values (each one id or a comma-separated list), deduplicated.

    Raises `UsageError` naming the first value that is not a positive integer.
    """
    ids: dict[int, None] = {}
    for value in values:
        for part in value.split(","):
            text = part.strip()
            if not text.isdigit() or int(text) < 1:
                raise UsageError(f"invalid message id {part.strip()!r}: use positive integers")
            ids[int(text)] = None
    return list(ids)


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
@click.option("--reason", help="why (required; stored in the audit row)")
@pass_state
def requeue_command(
    state: State, group: str, ids: tuple[str, ...], all_dead: bool, reason: str | None
) -> None:
    """Requeue dead rows of GROUP (audited): `--id ID ...` or `--all`, with `--reason`.

    Every id must be a dead row of the group, else nothing is requeued (exit 2).
    Prints `requeued N`.
    """
    if ids and all_dead:
        raise UsageError("--id and --all are mutually exclusive")
    if not ids and not all_dead:
        raise UsageError("give the rows to requeue: --id ID ... or --all")
    if not (reason or "").strip():
        raise UsageError("--reason is required and must not be empty")
    result = requeue(
        state.engine, group, parse_ids(ids) if ids else None, all_dead=all_dead, reason=reason or ""
    )
    click.echo(f"requeued {result.count}")
