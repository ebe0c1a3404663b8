"""Migrations: the migrated schema is exactly the declared tables, and concurrent runs agree.

"The declared tables" is what `pgq.schema.metadata` compiles to: SQLAlchemy's
DDL for it, run in a scratch schema, so PostgreSQL normalises the declaration
(types, default expressions, check constraints, index predicates) exactly as it
normalises what the migrations built. Both schemas are then read back from the
catalogs (`format_type`, `pg_get_expr`, `pg_get_constraintdef`,
`pg_get_indexdef`, `pg_sequences`) and compared object by object. A second
test checks that this comparison covers every declared object and that the
catalog types are the compiled type names; a third tampers with a migrated
schema in several ways and shows that each tampering is reported. A schema
that an earlier version created and today's migrations upgraded is compared
the same way.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fixtures.released import RELEASED, restore
from helpers import assert_usage_error, invoke
from sqlalchemy import (
    CheckConstraint,
    Connection,
    Engine,
    ForeignKeyConstraint,
    Identity,
    Table,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateSchema, DropSchema

import pgq
from pgq import schema as t
from pgq.errors import UsageError
from pgq.store import LATEST

Description = dict[str, Any]
"""Every object of a schema by a readable key (`column delivery.attempts`), with
its normalised definition."""

PLACEHOLDER = t.SCHEMA_PLACEHOLDER

_TABLES = """
SELECT c.relname, coalesce(c.reloptions, '{}') AS options
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
"""
_COLUMNS = """
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, pg_get_expr(d.adbin, d.adrelid) AS default,
       a.attidentity AS identity, a.attgenerated AS generated
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = :schema AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
"""
_CONSTRAINTS = """
SELECT c.relname, con.conname, con.contype, pg_get_constraintdef(con.oid) AS definition
FROM pg_constraint con
JOIN pg_class c ON c.oid = con.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema
"""
_INDEXES = """
SELECT c.relname, i.relname AS index, pg_get_indexdef(i.oid) AS definition
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class c ON c.oid = x.indrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema
"""
_SEQUENCES = """
SELECT sequencename, data_type::text AS type, start_value, min_value, max_value,
       increment_by, cycle, cache_size
FROM pg_sequences WHERE schemaname = :schema
"""
_TRIGGERS = """
SELECT c.relname, tg.tgname, pg_get_triggerdef(tg.oid) AS definition
FROM pg_trigger tg
JOIN pg_class c ON c.oid = tg.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema AND NOT tg.tgisinternal
"""


def describe(conn: Connection, schema: str) -> Description:
    """Every table, column, constraint, index, sequence and trigger of `schema`,
    with the schema's own name replaced by the placeholder `pgq`."""
    unqualify = re.compile(rf"(?<![\w$]){re.escape(schema)}\.")

    def norm(value: Any) -> Any:
        return unqualify.sub(f"{PLACEHOLDER}.", value) if isinstance(value, str) else value

    def rows(query: str) -> list[Any]:
        return conn.execute(text(query), {"schema": schema}).all()

    found: Description = {}
    for r in rows(_TABLES):
        found[f"table {r.relname}"] = {"options": sorted(r.options)}
    for r in rows(_COLUMNS):
        found[f"column {r.relname}.{r.attname}"] = {
            "type": r.type,
            "not null": r.not_null,
            "default": norm(r.default),
            "identity": r.identity,
            "generated": r.generated,
        }
    for r in rows(_CONSTRAINTS):
        found[f"constraint {r.relname}.{r.conname}"] = (r.contype, norm(r.definition))
    for r in rows(_INDEXES):
        found[f"index {r.relname}.{r.index}"] = norm(r.definition)
    for r in rows(_SEQUENCES):
        found[f"sequence {r.sequencename}"] = tuple(r)[1:]
    for r in rows(_TRIGGERS):
        found[f"trigger {r.relname}.{r.tgname}"] = norm(r.definition)
    return found


def differences(declared: Description, migrated: Description) -> list[str]:
    """What the migrated schema lacks, adds or defines differently, one line per object."""
    lines = []
    for key in sorted(declared.keys() | migrated.keys()):
        if key not in migrated:
            lines.append(f"{key}: missing (declared {declared[key]!r})")
        elif key not in declared:
            lines.append(f"{key}: not declared (migrated {migrated[key]!r})")
        elif declared[key] != migrated[key]:
            lines.append(f"{key}: declared {declared[key]!r}, migrated {migrated[key]!r}")
    return lines


@pytest.fixture
def declared(pg_dsn: str, schema: str) -> Iterator[Description]:
    """The declared tables as PostgreSQL sees them: `metadata.create_all` in a scratch schema."""
    scratch = f"{schema}_declared"
    eng = pgq.connect(pg_dsn, schema=scratch)
    try:
        with eng.begin() as conn:
            conn.execute(CreateSchema(scratch))
            t.metadata.create_all(conn, checkfirst=False)
            description = describe(conn, scratch)
        yield description
    finally:
        with eng.begin() as conn:
            conn.execute(DropSchema(scratch, cascade=True, if_exists=True))
        eng.dispose()


def migrated_schema(engine: Engine, schema: str) -> Description:
    with engine.connect() as conn:
        return describe(conn, schema)


def test_migrated_schema_matches_the_declared_tables(
    engine: Engine, schema: str, declared: Description
):
    assert differences(declared, migrated_schema(engine, schema)) == []


@pytest.mark.parametrize("version", RELEASED, ids=lambda v: f"v{v}")
def test_an_upgraded_schema_matches_the_declared_tables(
    pg_dsn: str, schema: str, declared: Description, version: int
):
    """A schema an earlier version created (`fixtures.released`), upgraded by today's
    migrations, ends in the declared tables too."""
    restore(pg_dsn, schema, version)
    engine = pgq.connect(pg_dsn, schema=schema)
    try:
        assert pgq.migrate(engine) == LATEST
        assert differences(declared, migrated_schema(engine, schema)) == []
    finally:
        engine.dispose()


# -- the comparison sees what is declared ------------------------------------------------------

_DIALECT = postgresql.dialect()
_TYPE_ALIASES = {
    "timestamp": "timestamp without time zone",
    "time": "time without time zone",
    "varchar": "character varying",
    "float": "double precision",
    "bool": "boolean",
}


def compiled_type(table: Table, column: str) -> str:
    """The column's declared type as the PostgreSQL dialect compiles it, normalised
    to `format_type` spelling (lower case, no blanks after commas, aliases spelled out)."""
    name = table.c[column].type.compile(dialect=_DIALECT).lower()
    name = re.sub(r",\s+", ",", name)
    return _TYPE_ALIASES.get(name, name)


def constraint_columns(definition: str) -> list[str]:
    """The column list of a `PRIMARY KEY (...)`/`UNIQUE (...)` definition."""
    match = re.match(r"(?:PRIMARY KEY|UNIQUE) \((.*)\)$", definition)
    assert match, definition
    return [c.strip() for c in match.group(1).split(",")]


def compiled_default(table: Table, column: str) -> str | None:
    """The column's declared server default as compiled, without casts of literals.

    An integer primary key without `Identity` is autoincrementing: SQLAlchemy
    compiles it as `SERIAL`, a default from the column's own sequence.
    """
    col = table.c[column]
    if col is table.autoincrement_column and col.identity is None:
        return f"nextval('{PLACEHOLDER}.{table.name}_{column}_seq')"
    default = col.server_default
    if default is None or isinstance(default, Identity):
        return None
    return without_literal_casts(str(default.arg.compile(dialect=_DIALECT)))  # type: ignore[attr-defined]


def without_literal_casts(sql: str | None) -> str | None:
    """`'ready'::text` as `'ready'`: PostgreSQL spells out the type of a literal."""
    return None if sql is None else re.sub(r"('(?:[^']|'')*')::[\w ]+", r"\1", sql)


def named(declared: Description, kind: str, table: str) -> dict[str, Any]:
    """The declared objects of `kind` on `table`, by name."""
    prefix = f"{kind} {table}."
    return {k[len(prefix) :]: v for k, v in declared.items() if k.startswith(prefix)}


def test_the_comparison_covers_every_declared_object(declared: Description):
    """Against the declared `Table`s directly: every table, column (compiled type name,
    nullability, default, identity), key, constraint and index shows up in the description."""
    tables = {tb.name: tb for tb in t.metadata.sorted_tables}
    assert {k.split(" ", 1)[1] for k in declared if k.startswith("table ")} == set(tables)
    for name, table in tables.items():
        columns = named(declared, "column", name)
        assert set(columns) == set(table.c.keys()), name
        for column in table.columns:
            found, where = columns[column.name], f"{name}.{column.name}"
            assert found["type"] == compiled_type(table, column.name), where
            assert found["not null"] == (not column.nullable), where
            assert without_literal_casts(found["default"]) == compiled_default(
                table, column.name
            ), where
            identity = column.identity
            assert found["identity"] == ("" if identity is None else "ad"[not identity.always])

        constraints = named(declared, "constraint", name)
        by_kind: dict[str, list[str]] = {}
        for kind, definition in constraints.values():
            by_kind.setdefault(kind, []).append(definition)
        assert [constraint_columns(d) for d in by_kind.get("p", [])] == [
            [c.name for c in table.primary_key]
        ], name
        assert sorted(constraint_columns(d) for d in by_kind.get("u", [])) == sorted(
            [c.name for c in con.columns]
            for con in table.constraints
            if isinstance(con, UniqueConstraint)
        ), name
        assert {n for n, (kind, _) in constraints.items() if kind == "c"} == {
            con.name for con in table.constraints if isinstance(con, CheckConstraint)
        }, name
        assert sorted(by_kind.get("f", [])) == sorted(
            f"FOREIGN KEY ({', '.join(c.name for c in con.columns)})"
            f" REFERENCES {PLACEHOLDER}.{con.elements[0].column.table.name}"
            f"({', '.join(e.column.name for e in con.elements)})"
            for con in table.constraints
            if isinstance(con, ForeignKeyConstraint)
        ), name

        indexes = named(declared, "index", name)
        backing = {n for n, (kind, _) in constraints.items() if kind in ("p", "u")}
        assert set(indexes) == {ix.name for ix in table.indexes} | backing, name
        for ix in table.indexes:
            definition = indexes[ix.name]
            unique = "UNIQUE " if ix.unique else ""
            cols = ", ".join(c.name for c in ix.columns)
            assert definition.startswith(
                f"CREATE {unique}INDEX {ix.name} ON {PLACEHOLDER}.{name} USING btree ({cols})"
            ), definition
            has_where = ix.dialect_options["postgresql"]["where"] is not None
            assert (" WHERE " in definition) == has_where, ix.name

    sequences = {k.split(" ", 1)[1] for k in declared if k.startswith("sequence ")}
    assert t.lease_token.name in sequences


# -- the comparison can fail ---------------------------------------------------------------------

TAMPERINGS = {
    "a default": (
        "ALTER TABLE {s}.delivery ALTER COLUMN attempts SET DEFAULT 1",
        "column delivery.attempts",
    ),
    "a type": ("ALTER TABLE {s}.member ALTER COLUMN pid TYPE bigint", "column member.pid"),
    "nullability": (
        "ALTER TABLE {s}.audit ALTER COLUMN reason DROP NOT NULL",
        "column audit.reason",
    ),
    "an extra column": ("ALTER TABLE {s}.message ADD COLUMN extra int", "column message.extra"),
    "an identity": (
        "ALTER TABLE {s}.audit ALTER COLUMN id SET GENERATED ALWAYS",
        "column audit.id",
    ),
    "a dropped index": ("DROP INDEX {s}.delivery_failed_idx", "index delivery.delivery_failed_idx"),
    "an extra index": (
        "CREATE INDEX message_key_idx ON {s}.message (key)",
        "index message.message_key_idx",
    ),
    "an index predicate": (
        "DROP INDEX {s}.delivery_ready_idx;"
        " CREATE INDEX delivery_ready_idx ON {s}.delivery (group_id, available_at, message_id)"
        " WHERE state = 'leased'",
        "index delivery.delivery_ready_idx",
    ),
    "index columns": (
        "DROP INDEX {s}.delivery_leased_idx;"
        " CREATE INDEX delivery_leased_idx ON {s}.delivery (lease_expires_at, group_id)"
        " WHERE state = 'leased'",
        "index delivery.delivery_leased_idx",
    ),
    "index uniqueness": (
        "DROP INDEX {s}.message_topic_id_idx;"
        " CREATE UNIQUE INDEX message_topic_id_idx ON {s}.message (topic_id, id)",
        "index message.message_topic_id_idx",
    ),
    "a check constraint": (
        "ALTER TABLE {s}.delivery DROP CONSTRAINT delivery_state_check;"
        " ALTER TABLE {s}.delivery ADD CONSTRAINT delivery_state_check"
        " CHECK (state IN ('ready', 'leased', 'done'))",
        "constraint delivery.delivery_state_check",
    ),
    "a primary key": (
        "ALTER TABLE {s}.member DROP CONSTRAINT member_pkey;"
        " ALTER TABLE {s}.member ADD PRIMARY KEY (name, group_id)",
        "constraint member.member_pkey",
    ),
    "a unique constraint": (
        "ALTER TABLE {s}.topic DROP CONSTRAINT topic_name_key",
        "constraint topic.topic_name_key",
    ),
    "a foreign key": (
        "ALTER TABLE {s}.breaker DROP CONSTRAINT breaker_group_id_fkey",
        "constraint breaker.breaker_group_id_fkey",
    ),
    "a storage option": ("ALTER TABLE {s}.delivery RESET (fillfactor)", "table delivery"),
    "a sequence": ("ALTER SEQUENCE {s}.lease_token CACHE 1", "sequence lease_token"),
    "a trigger": (
        "CREATE FUNCTION {s}.noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';"
        " CREATE TRIGGER noop BEFORE INSERT ON {s}.topic FOR EACH ROW EXECUTE FUNCTION {s}.noop()",
        "trigger topic.noop",
    ),
}


@pytest.mark.parametrize("statement, reported", TAMPERINGS.values(), ids=TAMPERINGS)
def test_a_schema_that_differs_is_reported(
    engine: Engine, schema: str, declared: Description, statement: str, reported: str
):
    with engine.begin() as conn:
        conn.exec_driver_sql(statement.format(s=schema))
    found = differences(declared, migrated_schema(engine, schema))
    assert any(line.startswith(f"{reported}:") for line in found), found


# -- concurrency ---------------------------------------------------------------------------------


def test_concurrent_migrations_apply_each_version_once(pg_dsn: str, schema: str):
    engines = [pgq.connect(pg_dsn, schema=schema) for _ in range(4)]
    results: list[int] = []
    threads = [threading.Thread(target=lambda e=e: results.append(pgq.migrate(e))) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [LATEST] * 4
    with engines[0].connect() as conn:
        versions = conn.execute(t.schema_version.select()).all()
    assert [v.version for v in versions] == list(range(1, LATEST + 1))
    for e in engines:
        e.dispose()


# -- distributed ---------------------------------------------------------------------------------


def test_distributed_needs_a_citus_coordinator(pg_dsn: str, schema: str, pgq_env: dict[str, str]):
    """On an ordinary server `--distributed` is refused before anything is written
    (the Citus placement itself is tested in tests/citus/)."""
    engine = pgq.connect(pg_dsn, schema=schema, pool_size=None)
    try:
        with pytest.raises(UsageError, match="needs a Citus coordinator"):
            pgq.migrate(engine, distributed=True)
        result = invoke(pgq_env, "init", "--distributed")
        assert_usage_error(result.exit_code, result.stderr, contains="citus extension")
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT to_regnamespace(:s)"), {"s": schema}) is None
    finally:
        engine.dispose()
