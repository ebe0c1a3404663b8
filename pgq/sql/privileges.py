"""The privileges a consumer's role needs on the schema, and the statement that
finds the ones it lacks.

A member checks them when it starts: a role that could claim rows but could never
open the group's breaker, run retention or leave the group would otherwise fail
later, one task at a time, or not at all where nobody looks. Row locks count as
updates: PostgreSQL lets a role lock rows (`FOR UPDATE`, `FOR KEY SHARE`) only
with UPDATE on the table, so retention needs UPDATE on `topic` and `message`.
"""

from __future__ import annotations

from functools import cache

from sqlalchemy import (
    Text,
    and_,
    bindparam,
    case,
    column,
    func,
    literal,
    literal_column,
    select,
    table,
    union_all,
    values,
)
from sqlalchemy.sql import Executable

CONSUMER_TABLES: dict[str, tuple[str, ...]] = {
    "topic": ("SELECT", "UPDATE"),  # UPDATE: retention locks the topic row (FOR KEY SHARE)
    "message": ("SELECT", "UPDATE", "DELETE"),  # retention locks and deletes expired ones
    "consumer_group": ("SELECT", "UPDATE"),  # the frontier and the running totals
    "delivery": ("SELECT", "UPDATE", "DELETE"),  # claims, outcomes, sweep, refunds, pruning
    "member": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # join, heartbeat, leave, forget
    "breaker": ("SELECT", "UPDATE"),  # open on quorum, probe, close
    "breaker_history": ("SELECT", "INSERT", "UPDATE"),  # transitions and refund counts
}
"""Table privileges a consumer member needs (besides USAGE on the schema)."""

CONSUMER_SEQUENCES: dict[str, tuple[str, ...]] = {
    "lease_token": ("USAGE",),  # a fresh lease token per claim (nextval)
}
"""Sequence privileges a consumer member needs."""

_namespaces = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")
_classes = table(
    "pg_class",
    column("oid"),
    column("relname"),
    column("relnamespace"),
    column("relkind"),
    schema="pg_catalog",
)


@cache
def missing_consumer_privileges() -> Executable:
    """(object, privilege) for each privilege a consumer needs in schema `:schema`
    that the current role lacks: `("schema", "USAGE")`, `("message", "SELECT")`, ...

    Looked up by oid in the catalogs, so it answers without USAGE on the schema;
    objects that do not exist are not reported (a missing schema is another error).
    """
    needs = values(column("relname", Text), column("privilege", Text), name="need").data(
        [
            (name, privilege)
            for objects in (CONSUMER_TABLES, CONSUMER_SEQUENCES)
            for name, privileges in objects.items()
            for privilege in privileges
        ]
    )
    n, c = _namespaces, _classes
    in_schema = select(n.c.oid).where(n.c.nspname == bindparam("schema")).scalar_subquery()
    granted = case(
        (c.c.relkind == "S", func.has_sequence_privilege(c.c.oid, needs.c.privilege)),
        else_=func.has_table_privilege(c.c.oid, needs.c.privilege),
    )
    objects = (
        select(needs.c.relname, needs.c.privilege)
        .select_from(
            needs.join(c, and_(c.c.relname == needs.c.relname, c.c.relnamespace == in_schema))
        )
        .where(~granted)
    )
    schema = select(literal("schema", Text), literal("USAGE", Text)).where(
        n.c.nspname == bindparam("schema"),
        ~func.has_schema_privilege(n.c.oid, literal("USAGE", Text)),
    )
    return union_all(schema, objects)


@cache
def current_role() -> Executable:
    """The role the session runs as."""
    return select(literal_column("current_user", Text))
