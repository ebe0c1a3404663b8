"""Every table that holds a topic's or a group's rows is covered by `pgq grant`'s
row-level restrictions (decision 0034): a table added later with a `group_id` or a
`topic_id` fails here until `pgq.sql.restrictions` lists it."""

from __future__ import annotations

from pgq import schema as t
from pgq.sql import restrictions


def test_every_table_of_a_topic_or_a_group_is_restricted():
    keyed = {
        table.name
        for table in t.metadata.tables.values()
        if {"group_id", "topic_id"} & set(table.c.keys())
    }
    assert keyed | {"topic", "consumer_group"} == set(restrictions.TABLES)
    assert set(restrictions.GROUP_KEYED) == {
        table.name for table in t.metadata.tables.values() if "group_id" in table.c
    }


def test_policy_names_fit_postgresql_names():
    biggest = 2**32 - 1  # an oid
    assert all(len(name) <= 63 for _, name in restrictions.policy_names(biggest))
