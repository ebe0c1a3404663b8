"""Row-level restrictions: what `pgq grant ROLE JOB --topic T --group G` adds to a
job's privileges, so that ROLE sees and touches only those topics' and groups'
rows (decision 0034).

Row-level security on every table that holds a topic's or a group's rows, with
two kinds of policy:

- `pgq_all`, permissive, to PUBLIC, `USING (true) WITH CHECK (true)`: every role
  sees every row, as before row-level security was on. The planner drops a
  `true` qual, so an unrestricted role's plans do not change; the table's owner
  (and a superuser) bypass row-level security altogether.
- `pgq_only_<oid>`, restrictive, to one role (by its oid, so a name of any
  length makes a name PostgreSQL keeps whole): AND-ed with `pgq_all`, it limits
  that role to its topics and groups. `topic` by id, `consumer_group` by id or
  topic; `message` by its topic and the group tables by their group, both as
  "a row of a topic (group) this role may see", so the two lists live in the
  `topic` and `consumer_group` policies only, and a group subscribed later to a
  topic given with `--topic` is included at once.
- `pgq_retain_<oid>` (delete) and `pgq_lock_<oid>` (lock, update) on `message`:
  only messages of the topics given whole (`--topic`). Retention deletes a
  message no group of its topic still holds; a role that sees only some groups
  of the topic cannot know that, and must not delete (nor lock) any.

Names are quoted identifiers and ids are integers read from the database:
nothing a user typed is pasted into the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

from psycopg import sql as psql
from sqlalchemy import BigInteger, Text, any_, bindparam, cast, func, literal, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import Executable
from sqlalchemy.sql.selectable import ScalarSelect

from pgq import schema as t
from pgq.sql import catalog

OPEN_POLICY = "pgq_all"
"""The permissive policy that keeps every unrestricted role seeing every row."""

TOPIC_KEYED = {"topic": "id", "message": "topic_id"}
"""Tables whose rows belong to a topic, by the column naming it."""

GROUP_KEYED = (
    "group_state",
    "delivery",
    "member",
    "breaker",
    "breaker_history",
    "probe",
    "audit",
    "attempt",
    "group_sample",
)
"""Tables whose rows belong to a group (their `group_id`)."""

TABLES = ("topic", "message", "consumer_group", *GROUP_KEYED)
"""Every table row-level security is on for once a role is restricted."""


def only_policy(oid: int) -> str:
    """The name of role `oid`'s restriction on each table."""
    return f"pgq_only_{oid}"


def retain_policy(oid: int) -> str:
    """The name of role `oid`'s restriction on deleting messages (retention)."""
    return f"pgq_retain_{oid}"


def lock_policy(oid: int) -> str:
    """The name of role `oid`'s restriction on locking messages (retention)."""
    return f"pgq_lock_{oid}"


def policy_names(oid: int) -> list[tuple[str, str]]:
    """(table, policy) for every policy that restricts role `oid`."""
    return [
        *((name, only_policy(oid)) for name in TABLES),
        ("message", retain_policy(oid)),
        ("message", lock_policy(oid)),
    ]


def _ids(ids: Iterable[int]) -> psql.Composable:
    """`'{1,2}'::integer[]`: ids read from the database, as one literal."""
    text = "{" + ",".join(str(int(i)) for i in sorted(set(ids))) + "}"
    return psql.SQL("{}::integer[]").format(psql.Literal(text))


def _in(col: str, ids: Iterable[int]) -> psql.Composable:
    return psql.SQL("{} = ANY ({})").format(psql.Identifier(col), _ids(ids))


def _visible(schema: str, col: str, of: str) -> psql.Composable:
    """`col IN (SELECT id FROM s.of)`: the row's topic (group) is one this role sees."""
    return psql.SQL("{} IN (SELECT {} FROM {})").format(
        psql.Identifier(col), psql.Identifier("id"), psql.Identifier(schema, of)
    )


def open_statements(
    schema: str, enabled: Iterable[str], opened: Iterable[str]
) -> list[psql.Composed]:
    """Row-level security on each of `TABLES` with `pgq_all` on it: nothing for a
    table already `enabled` with `pgq_all` already there (`opened`).

    `pgq_all` comes first: within the grant's transaction, and so at its commit,
    no role that saw every row loses one (roles granted by earlier versions, a
    monitoring role, an application that shares the owner's schema)."""
    enabled, opened = set(enabled), set(opened)
    statements = []
    for name in TABLES:
        on = psql.Identifier(schema, name)
        if name not in opened:
            statements.append(
                psql.SQL("CREATE POLICY {} ON {} USING (true) WITH CHECK (true)").format(
                    psql.Identifier(OPEN_POLICY), on
                )
            )
        if name not in enabled:
            statements.append(psql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(on))
    return statements


def drop_statements(schema: str, existing: Iterable[tuple[str, str]]) -> list[psql.Composed]:
    """`DROP POLICY` for each (table, policy) of `existing`."""
    return [
        psql.SQL("DROP POLICY {} ON {}").format(
            psql.Identifier(policy), psql.Identifier(schema, name)
        )
        for name, policy in existing
    ]


def fingerprint(topics: Iterable[int], whole_topics: Iterable[int], groups: Iterable[int]) -> str:
    """What a restriction allows, as the comment on its `topic` policy: a grant that
    would create the same policies finds it there and changes nothing (no lock)."""

    def ids(of: Iterable[int]) -> str:
        return ",".join(str(int(i)) for i in sorted(set(of)))

    allowed = f"topics {{{ids(topics)}}} whole {{{ids(whole_topics)}}} groups {{{ids(groups)}}}"
    return f"pgq grant: {allowed}"


def restrict_statements(
    schema: str,
    role: str,
    oid: int,
    topics: Iterable[int],
    whole_topics: Iterable[int],
    groups: Iterable[int],
) -> list[psql.Composed]:
    """The policies that limit `role` (oid `oid`) to topics `topics` (ids: those
    given, and the topics of the groups given), every group of `whole_topics`
    (the topics given with `--topic`) and groups `groups` (given with `--group`)."""
    whole, groups = sorted(set(whole_topics)), sorted(set(groups))
    to = psql.Identifier(role)
    group_rows = [_in("id", groups)] if groups else []
    if whole:
        group_rows.append(_in("topic_id", whole))
    using: dict[str, psql.Composable] = {
        "topic": _in("id", topics),
        "message": _visible(schema, "topic_id", "topic"),
        "consumer_group": psql.SQL(" OR ").join(group_rows),
        **{name: _visible(schema, "group_id", "consumer_group") for name in GROUP_KEYED},
    }
    statements = [
        psql.SQL("CREATE POLICY {} ON {} AS RESTRICTIVE TO {} USING ({}) WITH CHECK ({})").format(
            psql.Identifier(only_policy(oid)), psql.Identifier(schema, name), to, rows, rows
        )
        for name, rows in using.items()
    ]
    statements.append(
        psql.SQL("COMMENT ON POLICY {} ON {} IS {}").format(
            psql.Identifier(only_policy(oid)),
            psql.Identifier(schema, "topic"),
            psql.Literal(fingerprint(topics, whole, groups)),
        )
    )
    # `topic_id = ANY ('{}')` rather than `false` when no topic is given whole: the
    # planner makes it an index condition that finds nothing at once, where a
    # `false` security qual is a filter on every expired message retention reads
    retained = _in("topic_id", whole)
    for policy, command in ((retain_policy(oid), "DELETE"), (lock_policy(oid), "UPDATE")):
        statements.append(
            psql.SQL("CREATE POLICY {} ON {} AS RESTRICTIVE FOR {} TO {} USING ({})").format(
                psql.Identifier(policy),
                psql.Identifier(schema, "message"),
                psql.SQL(command),
                to,
                retained,
            )
        )
    return statements


def carry_statements(
    schema: str, table: str, restricted: Iterable[tuple[int, str]]
) -> list[psql.Composed]:
    """What a migration that adds group-keyed `table` runs in a schema where roles
    are restricted already: row-level security on it with `pgq_all`, and each
    restricted role's (oid, name) `pgq_only_<oid>` there as on the other group
    tables (which groups it sees is said by the `consumer_group` policy alone)."""
    on = psql.Identifier(schema, table)
    rows = _visible(schema, "group_id", "consumer_group")
    statements = [
        psql.SQL("CREATE POLICY {} ON {} USING (true) WITH CHECK (true)").format(
            psql.Identifier(OPEN_POLICY), on
        ),
        psql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(on),
    ]
    for oid, role in restricted:
        statements.append(
            psql.SQL(
                "CREATE POLICY {} ON {} AS RESTRICTIVE TO {} USING ({}) WITH CHECK ({})"
            ).format(psql.Identifier(only_policy(oid)), on, psql.Identifier(role), rows, rows)
        )
    return statements


# --- what is there ------------------------------------------------------------


def _in_schema() -> ScalarSelect[Any]:
    return (
        select(catalog.namespaces.c.oid)
        .where(catalog.namespaces.c.nspname == bindparam("schema", type_=Text))
        .scalar_subquery()
    )


@cache
def role_oid() -> Executable:
    """The oid of role `:role` (its exact name)."""
    return select(catalog.roles.c.oid).where(
        catalog.roles.c.rolname == bindparam("role", type_=Text)
    )


@cache
def bypasses() -> Executable:
    """Does role `:role` bypass row-level security on the tables of schema `:schema`:
    a superuser, a role with BYPASSRLS, or one with the privileges of a table's owner
    (the owner, or a member of it)? Then no policy restricts it."""
    c, r = catalog.classes, catalog.roles
    owns = (
        select(c.c.oid)
        .where(
            c.c.relnamespace == _in_schema(),
            c.c.relname.in_(TABLES),
            func.pg_has_role(r.c.oid, c.c.relowner, literal("USAGE", Text)),
        )
        .exists()
    )
    return select(r.c.rolsuper | r.c.rolbypassrls | owns).where(
        r.c.rolname == bindparam("role", type_=Text)
    )


@cache
def secured_tables() -> Executable:
    """The tables of schema `:schema` with row-level security on."""
    c = catalog.classes
    return select(c.c.relname).where(c.c.relnamespace == _in_schema(), c.c.relrowsecurity)


@cache
def policies() -> Executable:
    """(table, policy, its comment) for every policy on the tables of schema `:schema`."""
    c, p = catalog.classes, catalog.policies
    comment = func.obj_description(p.c.oid, literal("pg_policy", Text))
    return (
        select(c.c.relname, p.c.polname, comment)
        .select_from(p.join(c, c.c.oid == p.c.polrelid))
        .where(c.c.relnamespace == _in_schema())
        .order_by(c.c.relname, p.c.polname)
    )


@cache
def topics_named() -> Executable:
    """(id, name) of the topics named in `:names`."""
    tp = t.topic
    return select(tp.c.id, tp.c.name).where(
        tp.c.name == any_(bindparam("names", type_=ARRAY(Text)))
    )


@cache
def groups_named() -> Executable:
    """(id, name, topic_id) of the groups named in `:names`."""
    g = t.consumer_group
    return select(g.c.id, g.c.name, g.c.topic_id.label("topic_id")).where(
        g.c.name == any_(bindparam("names", type_=ARRAY(Text)))
    )


@cache
def role_names() -> Executable:
    """(oid, name) of the roles whose oids are in `:oids`."""
    r = catalog.roles
    return select(r.c.oid, r.c.rolname).where(
        cast(r.c.oid, BigInteger) == any_(bindparam("oids", type_=ARRAY(BigInteger)))
    )
