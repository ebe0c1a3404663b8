"""Statements the migrations run besides creating declared tables: moving columns
between tables of a schema in use (`pgq.store.migrations`)."""

from __future__ import annotations

from sqlalchemy import Column, Integer, MetaData, Table, insert, select, text, update
from sqlalchemy.sql import Executable, TextClause

from pgq import schema as t
from pgq.records import Start


def columns_of() -> Executable:
    """The column names of table `:table` in schema `:schema`."""
    return text(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = :schema AND table_name = :table"
    )


MOVED_TO_GROUP_STATE = (
    "committed_xid",
    "committed_id",
    "done_pruned",
    "reclaimed_total",
    "released_total",
    "refunded_total",
)
"""Schema version 4: the columns that moved from `consumer_group` to `group_state`."""


def copy_group_state(columns: list[str]) -> Executable:
    """Schema version 4: each group's `columns` (frontier and totals), as
    `consumer_group` held them, into its new `group_state` row."""
    before = Table(
        t.consumer_group.name,
        MetaData(schema=t.SCHEMA_PLACEHOLDER),
        Column("id", Integer),
        *(Column(name, t.group_state.c[name].type) for name in columns),
    )
    return insert(t.group_state).from_select(
        ["group_id", *columns], select(before.c.id, *(before.c[name] for name in columns))
    )


def drop_columns(qualified: str, columns: list[str]) -> TextClause:
    """Drop `columns` (names pgq declares) from table `qualified` (quoted and
    schema-qualified)."""
    drops = ", ".join(f'DROP COLUMN "{name}"' for name in columns)
    return text(f"ALTER TABLE {qualified} {drops}")


def delivery_xid_default(qualified: str) -> TextClause:
    """Schema version 4: a delivery row's xid is its inserting transaction's
    (`qualified`: the delivery table, quoted and schema-qualified)."""
    return text(f"ALTER TABLE {qualified} ALTER COLUMN xid SET DEFAULT pg_current_xact_id()")


def add_text_columns(qualified: str, columns: list[str]) -> TextClause:
    """Add nullable text `columns` (names pgq declares) to table `qualified` (quoted
    and schema-qualified), without defaults: the rows there stay NULL."""
    adds = ", ".join(f'ADD COLUMN "{name}" text' for name in columns)
    return text(f"ALTER TABLE {qualified} {adds}")


def add_group_start(qualified: str) -> TextClause:
    """Schema version 6: where a group started (`qualified`: the consumer_group table,
    quoted and schema-qualified); NULL for the groups that exist."""
    starts = ", ".join(f"'{start.value}'" for start in Start)
    return text(
        f"ALTER TABLE {qualified} ADD COLUMN start text"
        f" CONSTRAINT consumer_group_start_check CHECK (start IN ({starts}))"
    )


def add_dedupe_key(qualified: str) -> TextClause:
    """Schema version 7: the message's dedupe key (`qualified`: the message table,
    quoted and schema-qualified); NULL for the messages that exist. Adding a nullable
    column without a default rewrites nothing: the lock it takes is held for no scan."""
    return text(f"ALTER TABLE {qualified} ADD COLUMN dedupe_key text")


def add_group_ordered(qualified: str) -> TextClause:
    """Schema version 8: whether a group is ordered (`qualified`: the consumer_group
    table, quoted and schema-qualified); false for the groups that exist. A constant
    default is stored once, in the catalog: no row is rewritten."""
    return text(f"ALTER TABLE {qualified} ADD COLUMN ordered boolean NOT NULL DEFAULT false")


def add_delivery_events(qualified: str) -> TextClause:
    """Schema version 9: how many history lines a delivery row has written
    (`qualified`: the delivery table, quoted and schema-qualified); 0 for the rows
    that exist. A constant default is stored once, in the catalog: no row is
    rewritten."""
    return text(f"ALTER TABLE {qualified} ADD COLUMN events integer NOT NULL DEFAULT 0")


def add_group_xid_space(qualified: str) -> TextClause:
    """Schema version 10: the xid space of each group's frontier (`qualified`: the
    group_state table, quoted and schema-qualified); NULL until
    `pgq.sql.frontier.name_xid_space`."""
    return text(f"ALTER TABLE {qualified} ADD COLUMN xid_space bigint")


def index_as_declared() -> Executable:
    """Whether index `:index` (a qualified name) is the one declared: valid, unique,
    on the columns `:columns` in that order, with the predicate `:predicate` (as
    `pg_get_expr` prints it). No row when there is no such index; false for one a
    failed `CREATE INDEX CONCURRENTLY` left behind, or one built otherwise by hand."""
    return text(
        "SELECT i.indisvalid AND i.indisunique"
        " AND coalesce(pg_catalog.pg_get_expr(i.indpred, i.indrelid), '') = :predicate"
        " AND ARRAY(SELECT a.attname::text"
        "   FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n)"
        "   JOIN pg_catalog.pg_attribute a"
        "     ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        "   ORDER BY k.n) = CAST(:columns AS text[])"
        " AND i.indnkeyatts = i.indnatts"
        " FROM pg_catalog.pg_index i WHERE i.indexrelid = pg_catalog.to_regclass(:index)"
    )


def drop_index(qualified: str) -> TextClause:
    """Drop index `qualified` (quoted and schema-qualified)."""
    return text(f"DROP INDEX {qualified}")


def role_default(qualified: str) -> TextClause:
    """Schema version 5: an audit row's role is the inserting session's `current_user`
    (`qualified`: the audit table, quoted and schema-qualified)."""
    return text(f"ALTER TABLE {qualified} ALTER COLUMN role SET DEFAULT CURRENT_USER")


def name_audit_rows() -> Executable:
    """Schema version 5: the group's and the topic's names in the audit rows written
    before, for the groups that exist."""
    a, g, tp = t.audit, t.consumer_group, t.topic
    return (
        update(a)
        .where(a.c.group_id == g.c.id, g.c.topic_id == tp.c.id, a.c.group_name.is_(None))
        .values(group_name=g.c.name, topic=tp.c.name)
    )
