"""Every table has a place on Citus (`pgq init --distributed`): a table added to
`pgq.schema` without one would stay on the coordinator, out of every router plan."""

from __future__ import annotations

from pgq import schema as t
from pgq.sql import placement


def test_every_table_is_placed_once():
    placed = [*placement.REFERENCE, *placement.BY_GROUP, *placement.BY_TOPIC]
    names = [table.name for table in placed]
    assert sorted(names) == sorted(table.name for table in t.metadata.sorted_tables)


def test_distributed_tables_key_on_their_distribution_column():
    for table in (*placement.BY_GROUP, *placement.BY_TOPIC):
        column = placement.DISTRIBUTION_COLUMN[table.name]
        key = placement.PRIMARY_KEY_ON_CITUS.get(
            table.name, tuple(c.name for c in table.primary_key.columns)
        )
        assert column in key, (table.name, key)
    assert placement.BY_GROUP[0] is placement.ANCHOR
