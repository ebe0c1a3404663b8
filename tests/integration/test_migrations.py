"""Migrations: the migrated schema is exactly the declared tables, and concurrent runs agree."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import Engine, inspect

import pgq
from pgq import schema as t
from pgq.migrations import LATEST


@pytest.mark.filterwarnings("ignore:Did not recognize type 'xid8'")
def test_migrated_schema_matches_the_declared_tables(engine: Engine, schema: str):
    insp = inspect(engine)
    assert set(insp.get_table_names(schema=schema)) == {tb.name for tb in t.metadata.sorted_tables}
    for table in t.metadata.sorted_tables:
        columns = {c["name"]: c for c in insp.get_columns(table.name, schema=schema)}
        assert set(columns) == {c.name for c in table.columns}, table.name
        for column in table.columns:
            assert columns[column.name]["nullable"] == column.nullable, (table.name, column.name)
        indexes = {i["name"] for i in insp.get_indexes(table.name, schema=schema)}
        assert indexes >= {i.name for i in table.indexes}, table.name


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
