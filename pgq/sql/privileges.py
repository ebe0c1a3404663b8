"""The privileges each job needs on the schema, the statements that grant them,
and the statement that finds the ones a role lacks.

Three jobs, one shape: `<JOB>_TABLES` (table name to privileges, or
`table.column` to privileges on that column) and `<JOB>_SEQUENCES` (sequence
name to privileges), besides USAGE on the schema.
Each list is exact: every entry was found needed by removing it and watching
the job fail (`tests/integration/test_consumer_privileges.py`,
`tests/integration/test_roles.py`), and a role with exactly the list does the
whole job. Why the jobs are cut this way: `docs/decisions/0018-roles.md`.

Row locks count as updates: PostgreSQL lets a role lock rows (`FOR UPDATE`,
`FOR KEY SHARE`) only with UPDATE on at least one column of the table. pgq
never updates a `topic` or a `message` row, it only locks them (publishing
locks the topic row, retention the topic row and the expired messages), so the
producer and the consumer get UPDATE on one column there, `created_at`, which
no statement writes: UPDATE on the whole table would let a producer rename
topics and a consumer rewrite payloads. `RETURNING` reads what it returns, so
an insert that returns ids needs SELECT on the id column, and no more: a
producer reads no payload. Identity columns (`message.id`, `audit.id`) draw from their
sequences without USAGE on them; `lease_token` is a plain sequence.

A member checks the consumer's list when it starts: a role that could claim
rows but could never open the group's breaker, run retention or leave the
group would otherwise fail later, one task at a time, or not at all where
nobody looks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache

from psycopg import sql as psql
from sqlalchemy import (
    Boolean,
    Text,
    and_,
    bindparam,
    case,
    column,
    exists,
    func,
    literal,
    literal_column,
    select,
    true,
    union_all,
    values,
)
from sqlalchemy.sql import ColumnElement, Executable
from sqlalchemy.sql.functions import Function

from pgq.sql import catalog

CONSUMER_TABLES: dict[str, tuple[str, ...]] = {
    "topic": ("SELECT",),
    "topic.created_at": ("UPDATE",),  # only to lock: retention locks the topic (FOR KEY SHARE)
    "message": ("SELECT", "DELETE"),  # retention deletes expired ones
    "message.created_at": ("UPDATE",),  # only to lock: retention locks them (FOR UPDATE)
    "consumer_group": ("SELECT",),  # the groups of the topic (retention)
    "group_state": ("SELECT", "UPDATE"),  # the frontier and the running totals
    "delivery": ("SELECT", "UPDATE", "DELETE"),  # claims, outcomes, sweep, refunds, pruning
    "member": ("SELECT", "INSERT", "UPDATE", "DELETE"),  # join, heartbeat, leave, forget
    "breaker": ("SELECT", "UPDATE"),  # open on quorum, probe, close
    "breaker_history": ("SELECT", "INSERT", "UPDATE"),  # transitions and refund counts
    # the probe log: each probe's outcome writes one; retention deletes the old ones
    # (and reads their `at` to choose them: SELECT)
    "probe": ("SELECT", "INSERT", "DELETE"),
    # a message's history: failures, reclaims and refunds write a line (a slot's
    # older line rewritten: UPDATE); retention deletes old lines
    "attempt": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    # the charts' samples (schema version 9): a member writes its group's minute
    # unless one is there (SELECT), retention deletes the old ones
    "group_sample": ("SELECT", "INSERT", "DELETE"),
}
"""Table privileges a consumer member needs (besides USAGE on the schema)."""

CONSUMER_SEQUENCES: dict[str, tuple[str, ...]] = {
    "lease_token": ("USAGE",),  # a block of lease tokens per member (nextval)
}
"""Sequence privileges a consumer member needs."""

PRODUCER_TABLES: dict[str, tuple[str, ...]] = {
    "topic": ("SELECT",),
    "topic.created_at": ("UPDATE",),  # only to lock: publishing locks the topic (FOR KEY SHARE)
    "message": ("INSERT",),
    "message.id": ("SELECT",),  # the insert returns the new ids; never a payload
    # idempotent publish (schema version 7): the insert returns the keys it inserted,
    # and the id of a key already there is read by (topic, key); never a payload
    "message.topic_id": ("SELECT",),
    "message.dedupe_key": ("SELECT",),
    "consumer_group": ("SELECT",),  # the groups of the topic
    "delivery": ("INSERT",),  # one ready row per group
}
"""Table privileges a producer needs (besides USAGE on the schema): `publish`,
`publish_many` (inside the caller's transaction too, with `delay`), `pgq publish`."""

PRODUCER_SEQUENCES: dict[str, tuple[str, ...]] = {}
"""Sequence privileges a producer needs: none (message ids are an identity column)."""

ADMIN_REMOVALS: dict[str, tuple[str, ...]] = {
    "topic": ("DELETE",),  # topic delete
    "topic.created_at": ("UPDATE",),  # only to lock: unsubscribe and topic delete (FOR UPDATE)
    "message": ("DELETE",),  # topic delete
    "consumer_group": ("DELETE",),  # unsubscribe: the group, and the rows it has below
    "group_state": ("DELETE",),
    "member": ("DELETE",),
    "breaker": ("DELETE",),
    "breaker_history": ("DELETE",),
    "probe": ("DELETE",),
    "group_sample": ("DELETE",),
}
"""What `unsubscribe` and `topic delete` need besides the rest of the administrator's
list (schema version 5 carries them to the roles granted that list before:
`REMOVALS_CARRIED`)."""

ADMIN_TABLES: dict[str, tuple[str, ...]] = {
    "topic": ("SELECT", *ADMIN_REMOVALS["topic"]),  # groups by name, with their topic
    "topic.created_at": ADMIN_REMOVALS["topic.created_at"],
    "message": ("SELECT", *ADMIN_REMOVALS["message"]),  # show
    "consumer_group": ("SELECT", *ADMIN_REMOVALS["consumer_group"]),  # groups
    "group_state": ("SELECT", *ADMIN_REMOVALS["group_state"]),  # frontier, totals
    "delivery": ("SELECT", "UPDATE", "DELETE"),  # requeue (locks, updates), purge, counts
    "member": ("SELECT", *ADMIN_REMOVALS["member"]),  # status, members, breaker (who probes)
    # status, breaker, check, purge (what a reconciliation owes)
    "breaker": ("SELECT", *ADMIN_REMOVALS["breaker"]),
    "breaker_history": ("SELECT", *ADMIN_REMOVALS["breaker_history"]),  # breaker
    "probe": ("SELECT", *ADMIN_REMOVALS["probe"]),  # breaker (its probes)
    # a message's history (web); unsubscribe deletes the group's (schema version 9:
    # not among `ADMIN_REMOVALS`, which version 5 carries)
    "attempt": ("SELECT", "DELETE"),
    "audit": ("SELECT", "INSERT"),  # every audited change writes it (and returns its id)
    # the charts (schema version 9): `pgq web` reads them, and writes the minute's
    # sample of a group no member sampled (SELECT to see that first)
    "group_sample": ("SELECT", "INSERT", *ADMIN_REMOVALS["group_sample"]),
}
"""Table privileges an administrator needs (besides USAGE on the schema): audited
`requeue`, `purge`, `unsubscribe` and `topic delete`, and every read-only command
(`status`, `members`, `breaker`, `dead`, `check`, `show`, `audit`, `topics`)."""

ADMIN_SEQUENCES: dict[str, tuple[str, ...]] = {}
"""Sequence privileges an administrator needs: none (audit ids are an identity column)."""

Carried = dict[tuple[str, str], tuple[str, ...]]
"""(table, privilege a role holds there) to the privileges it gets on a new table."""

PROBE_LOG_CARRIED: Carried = {
    ("breaker_history", "INSERT"): CONSUMER_TABLES["probe"],
    ("breaker_history", "SELECT"): ADMIN_TABLES["probe"],
}
"""Schema version 3 adds `probe`: a role granted INSERT on `breaker_history` before
(a consumer's) gets a consumer's privileges on it, one granted SELECT there (an
administrator, a monitoring role) gets SELECT, so an upgrade keeps every role able
to do the job it did (decision 0022)."""

GROUP_STATE_CARRIED: Carried = {
    ("consumer_group", "UPDATE"): CONSUMER_TABLES["group_state"],
    ("breaker_history", "SELECT"): ADMIN_TABLES["group_state"],
}
"""Schema version 4 moves the frontier and the totals from `consumer_group` to
`group_state`: a role that could update them before (a consumer's) may still, one
that reads the breaker's history (an administrator, a monitoring role) reads them.
A producer (SELECT on `consumer_group` only) needs nothing there."""


HISTORY_CARRIED: Carried = {
    ("probe", "INSERT"): CONSUMER_TABLES["attempt"],
    ("probe", "SELECT"): ("SELECT",),
    ("audit", "INSERT"): ADMIN_TABLES["attempt"],
}
"""Schema version 9 adds `attempt`: a role granted INSERT on the probe log before (a
consumer's) gets a consumer's privileges on it, one granted INSERT on `audit` (an
administrator's) an administrator's, one that reads the probe log (a monitoring
role) reads the history too (decision 0046)."""


DEDUPE_CARRIED: dict[str, Carried] = {
    name: {("message", "INSERT"): PRODUCER_TABLES[name]}
    for name in ("message.topic_id", "message.dedupe_key")
}
"""Schema version 7 lets a producer publish with dedupe keys: a role granted INSERT on
`message` before (a producer's) gets SELECT on the two columns that needs."""


SAMPLES_CARRIED: Carried = {
    ("breaker_history", "INSERT"): CONSUMER_TABLES["group_sample"],
    ("breaker_history", "SELECT"): ("SELECT",),
    ("audit", "INSERT"): ADMIN_TABLES["group_sample"],
}
"""Schema version 9 adds `group_sample`: a role granted INSERT on `breaker_history`
before (a consumer's) gets a consumer's privileges on it, one granted INSERT on
`audit` (an administrator's) an administrator's, one that reads the breaker's
history (a monitoring role) reads the samples too (decision 0045)."""


REMOVALS_CARRIED: dict[str, Carried] = {
    name: {("audit", "INSERT"): privileges}
    for name, privileges in ADMIN_REMOVALS.items()
    if name != "group_sample"  # schema version 9's (`SAMPLES_CARRIED`)
}
"""Schema version 5 lets an administrator remove groups and topics: a role granted
INSERT on `audit` before (an administrator's) gets `ADMIN_REMOVALS`, by table."""


@dataclass(frozen=True, slots=True)
class Job:
    """What one job needs on the schema, besides USAGE on it."""

    name: str
    tables: Mapping[str, tuple[str, ...]]
    sequences: Mapping[str, tuple[str, ...]]

    def objects(self) -> list[tuple[str, str]]:
        """Every (object, privilege) the job needs, `("schema", "USAGE")` first; the
        object of a column privilege is `table.column`."""
        return [
            ("schema", "USAGE"),
            *(
                (name, privilege)
                for objects in (self.tables, self.sequences)
                for name, privileges in objects.items()
                for privilege in privileges
            ),
        ]


def table_and_column(name: str) -> tuple[str, str | None]:
    """`("topic", "created_at")` for the column entry `topic.created_at`,
    `("message", None)` for the table entry `message`."""
    table_name, _, column_name = name.partition(".")
    return table_name, column_name or None


JOBS: dict[str, Job] = {
    "producer": Job("producer", PRODUCER_TABLES, PRODUCER_SEQUENCES),
    "consumer": Job("consumer", CONSUMER_TABLES, CONSUMER_SEQUENCES),
    "admin": Job("admin", ADMIN_TABLES, ADMIN_SEQUENCES),
}
"""The jobs `pgq grant` knows, by the flag that names them."""


# --- granting -----------------------------------------------------------------


def grant_statement(
    kind: str, schema: str, name: str, privileges: Iterable[str], role: str
) -> psql.Composed:
    """`GRANT SELECT, INSERT ON TABLE "s"."message" TO "role"` for `kind` TABLE or
    SEQUENCE; for a column entry `topic.created_at`, `GRANT UPDATE ("created_at")
    ON TABLE "s"."topic" TO "role"`. Names are quoted identifiers."""
    table_name, column_name = table_and_column(name)
    granted: list[psql.Composable]
    if column_name is None:
        granted = [psql.SQL(p) for p in privileges]
    else:
        on = psql.Identifier(column_name)
        granted = [psql.SQL("{} ({})").format(psql.SQL(p), on) for p in privileges]
    return psql.SQL("GRANT {} ON {} {} TO {}").format(
        psql.SQL(", ").join(granted),
        psql.SQL(kind),
        psql.Identifier(schema, table_name),
        psql.Identifier(role),
    )


def grant_statements(job: str, schema: str, role: str) -> list[psql.Composed]:
    """The GRANT statements that give `role` what `job` needs on `schema`: USAGE on
    the schema, then one statement per entry of its lists (a table, a column, a
    sequence). Names are quoted identifiers (`psycopg.sql.Identifier`), never
    text pasted into SQL. GRANT is idempotent: running them again changes nothing."""
    need = JOBS[job]
    statements = [
        psql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            psql.Identifier(schema), psql.Identifier(role)
        )
    ]
    for kind, objects in (("TABLE", need.tables), ("SEQUENCE", need.sequences)):
        for name, privileges in objects.items():
            statements.append(grant_statement(kind, schema, name, privileges, role))
    return statements


@cache
def role_exists() -> Executable:
    """Is there a role named `:role` (its exact name, not an identifier to parse)?"""
    return select(exists().where(catalog.roles.c.rolname == bindparam("role", type_=Text)))


# --- checking -----------------------------------------------------------------


def _has(check: str, of_role: bool, *args: ColumnElement[object]) -> ColumnElement[bool]:
    """`has_<check>_privilege(...)` for the current role, or for role `:role`."""
    name = f"has_{check}_privilege"
    if of_role:
        return Function(name, bindparam("role", type_=Text), *args, type_=Boolean())
    return Function(name, *args, type_=Boolean())


@cache
def missing_privileges(job: str, of_role: bool = False) -> Executable:
    """(object, privilege) for each privilege `job` needs in schema `:schema` that
    the current role (with `of_role`: role `:role`) lacks: `("schema", "USAGE")`,
    `("message", "SELECT")`, `("topic.created_at", "UPDATE")`, ...

    Looked up by oid in the catalogs, so it answers without USAGE on the schema;
    objects that do not exist are not reported (a missing schema is another error).
    A column privilege is held on the column or on the whole table (a role granted
    UPDATE on `topic` by an earlier pgq has UPDATE on `topic.created_at`).
    """
    need = JOBS[job]
    needs = values(
        column("object", Text),
        column("relname", Text),
        column("attname", Text),
        column("privilege", Text),
        name="need",
    ).data(
        [
            (name, *table_and_column(name), privilege)
            for name, privilege in need.objects()
            if name != "schema"
        ]
    )
    n, c, a = catalog.namespaces, catalog.classes, catalog.attributes
    in_schema = select(n.c.oid).where(n.c.nspname == bindparam("schema")).scalar_subquery()
    granted = case(
        (c.c.relkind == "S", _has("sequence", of_role, c.c.oid, needs.c.privilege)),
        (
            needs.c.attname.is_not(None),  # no such column: attnum is null, and so is this
            _has("column", of_role, c.c.oid, a.c.attnum, needs.c.privilege),
        ),
        else_=_has("table", of_role, c.c.oid, needs.c.privilege),
    )
    column_of = and_(a.c.attrelid == c.c.oid, a.c.attname == needs.c.attname, ~a.c.attisdropped)
    objects = (
        select(needs.c.object, needs.c.privilege)
        .select_from(
            needs.join(
                c, and_(c.c.relname == needs.c.relname, c.c.relnamespace == in_schema)
            ).outerjoin(a, column_of)
        )
        .where(~granted)
    )
    schema = select(literal("schema", Text), literal("USAGE", Text)).where(
        n.c.nspname == bindparam("schema"),
        ~_has("schema", of_role, n.c.oid, literal("USAGE", Text)),
    )
    return union_all(schema, objects)


@cache
def grantees() -> Executable:
    """The roles granted `:privilege` on table `:table` of schema `:schema` in its ACL,
    by name: not its owner, nor PUBLIC (no role of that name)."""
    n, c, r = catalog.namespaces, catalog.classes, catalog.roles
    in_schema = select(n.c.oid).where(n.c.nspname == bindparam("schema")).scalar_subquery()
    acl = (
        func.aclexplode(c.c.relacl)
        .table_valued(column("grantee"), column("privilege_type", Text))
        .lateral("acl")
    )
    return (
        select(r.c.rolname)
        .distinct()
        .select_from(c.join(acl, true()).join(r, r.c.oid == acl.c.grantee))
        .where(
            c.c.relname == bindparam("table", type_=Text),
            c.c.relnamespace == in_schema,
            acl.c.privilege_type == bindparam("privilege", type_=Text),
            acl.c.grantee != c.c.relowner,
        )
        .order_by(r.c.rolname)
    )


@cache
def current_role() -> Executable:
    """The role the session runs as."""
    return select(literal_column("current_user", Text))
