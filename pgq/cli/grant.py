"""Least-privilege roles: `pgq grant ROLE (--producer | --consumer | --admin)
[--topic T ...] [--group G ...] [--print]`.

Grants ROLE exactly what one job needs on the schema (`pgq.store.privileges`,
whose lists are `pgq.sql.privileges`), in one transaction, and prints the
statements it ran, one per line. With `--topic`/`--group` the role is also
restricted to those topics' and groups' rows (row-level security,
`pgq.sql.restrictions`), replacing any restriction it had; without them a
restriction it had is lifted. With `--print` it prints the same lines and runs
nothing (no database is needed without `--topic`/`--group`: the schema comes
from `--schema` or `PGQ_SCHEMA`; with them the ids are read from it). Run it as
the schema's owner, the role that ran `pgq init`.
"""

from __future__ import annotations

import click

from pgq.cli.base import State, pass_state
from pgq.errors import UsageError
from pgq.store import resolve_schema
from pgq.store.privileges import grant, grant_sql

__all__ = ["grant_command"]


@click.command("grant")
@click.argument("role")
@click.option("--producer", is_flag=True, help="publish: pgq.publish, publish_many, pgq publish")
@click.option("--consumer", is_flag=True, help="consume: a member of any group (pgq consume)")
@click.option(
    "--admin",
    is_flag=True,
    help="requeue, purge, and the read-only status, members, breaker, dead, check, show, audit",
)
@click.option(
    "--topic",
    "topics",
    multiple=True,
    help="only this topic's rows (repeatable); a consumer or admin: all its groups",
)
@click.option("--group", "groups", multiple=True, help="only this group's rows (repeatable)")
@click.option(
    "--print", "print_only", is_flag=True, help="print the GRANT statements and run nothing"
)
@pass_state
def grant_command(
    state: State,
    role: str,
    producer: bool,
    consumer: bool,
    admin: bool,
    topics: tuple[str, ...],
    groups: tuple[str, ...],
    print_only: bool,
) -> None:
    """Grant ROLE exactly what one job needs on the schema (idempotent).

    Give exactly one of `--producer`, `--consumer`, `--admin`. With `--topic`
    and `--group` ROLE sees and touches only those topics' and groups' rows
    (this replaces its earlier restriction; a grant without them lifts it).
    Prints the statements run, one per line; `--print` prints them and runs
    nothing. The role must exist (unless `--print` without `--topic`/`--group`);
    run this as the schema's owner.
    """
    flags = {"producer": producer, "consumer": consumer, "admin": admin}
    chosen = [job for job, on in flags.items() if on]
    if len(chosen) != 1:
        raise UsageError("give exactly one of --producer, --consumer, --admin")
    if print_only and not (topics or groups):
        statements = grant_sql(resolve_schema(state.schema), role, chosen[0])
    else:
        statements = grant(
            state.engine, role, chosen[0], topics=topics, groups=groups, dry_run=print_only
        )
    for statement in statements:
        click.echo(statement)
