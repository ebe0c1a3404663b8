"""Statements behind a group's and a topic's whole life past `subscribe`: `pgq topics`
lists the topics, `pgq unsubscribe` removes a group with its rows, `pgq topic delete`
removes a topic with its messages.

The removals delete by the distribution column of each table (`group_id`,
`topic_id`), so on Citus each statement is routed to one shard (decision 0023);
the deletes that matter to the audit row return how many rows went and the
smallest `:max_listed` of their ids in one statement (`pgq.sql.admin.listed_ids`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import Integer, Table, Text, bindparam, cast, delete, func, null, select
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.sql import Executable, Select

from pgq import schema as t
from pgq.sql.admin import listed_ids

UNSUBSCRIBE_ACTION = "unsubscribe"
"""The `audit.action` of a group's removal."""

DELETE_TOPIC_ACTION = "delete-topic"
"""The `audit.action` of a topic's removal (its row's group is `schema.NO_GROUP`)."""

GROUP_TABLES: tuple[Table, ...] = (
    t.group_sample,
    t.member,
    t.probe,
    t.attempt,
    t.breaker_history,
    t.breaker,
    t.group_state,
)
"""What a group has besides its delivery rows, deleted in this order (the last two
refer to `consumer_group`) before the group itself."""


@cache
def topics_with_groups() -> Select[Any]:
    """Every topic (`name`, `id`, `created_at`) with the names of its groups in name
    order (`groups`, empty without any) and whether each is ordered (`ordered`, in
    the same order), by name. Reads the catalogue tables only (on Citus, reference
    tables: the message counts are `messages_by_topic`)."""
    tp, g = t.topic, t.consumer_group
    # an outer join: a topic without groups aggregates one NULL name, removed here
    names = func.array_remove(func.array_agg(aggregate_order_by(g.c.name, g.c.name)), null())
    ordered = func.array_agg(aggregate_order_by(g.c.ordered, g.c.name))
    return (
        select(tp.c.name, tp.c.id, tp.c.created_at, names.label("groups"), ordered.label("ordered"))
        .select_from(tp.outerjoin(g, g.c.topic_id == tp.c.id))
        .group_by(tp.c.id)
        .order_by(tp.c.name)
    )


@cache
def messages_by_topic() -> Select[Any]:
    """How many messages each topic retains (`topic_id`, `n`; topics without any have
    no row)."""
    m = t.message
    return select(m.c.topic_id, func.count().label("n")).group_by(m.c.topic_id)


@cache
def groups_of_topic() -> Select[Any]:
    """The names of topic `:topic_id`'s groups, in name order."""
    g = t.consumer_group
    return (
        select(g.c.name)
        .where(g.c.topic_id == bindparam("topic_id", type_=Integer))
        .order_by(g.c.name)
    )


def _deleted(table: Table, key: str, param: str, id_column: str) -> Executable:
    gone = (
        delete(table)
        .where(table.c[key] == bindparam(param, type_=Integer))
        .returning(table.c[id_column])
        .cte("gone")
    )
    count = select(func.count()).select_from(gone).scalar_subquery()
    return select(count.label("n"), cast(listed_ids(gone, id_column), Text).label("ids"))


@cache
def delete_deliveries() -> Executable:
    """Delete every delivery row of group `:gid`: one statement, in the removal's
    transaction (decision 0033). Returns how many (`n`) and the smallest
    `:max_listed` message ids (`ids`, a JSON array as text)."""
    return _deleted(t.delivery, "group_id", "gid", "message_id")


@cache
def delete_group_rows(table_name: str) -> Executable:
    """Delete the rows of group `:gid` in `table_name` (one of `GROUP_TABLES`)."""
    table = next(tb for tb in GROUP_TABLES if tb.name == table_name)
    return delete(table).where(table.c.group_id == bindparam("gid", type_=Integer))


@cache
def delete_group() -> Executable:
    """Delete group `:gid`'s own row (after every row that refers to it)."""
    g = t.consumer_group
    return delete(g).where(g.c.id == bindparam("gid", type_=Integer))


@cache
def group_exists() -> Select[Any]:
    """A row when group `:gid` exists (a joining member asks, under `group_key`)."""
    g = t.consumer_group
    return select(g.c.id).where(g.c.id == bindparam("gid", type_=Integer))


@cache
def delete_messages() -> Executable:
    """Delete every message of topic `:topic_id`. Returns how many (`n`) and the
    smallest `:max_listed` ids (`ids`, a JSON array as text)."""
    return _deleted(t.message, "topic_id", "topic_id", "id")


@cache
def delete_topic() -> Executable:
    """Delete topic `:topic_id`'s own row (it has no group left)."""
    tp = t.topic
    return delete(tp).where(tp.c.id == bindparam("topic_id", type_=Integer))
