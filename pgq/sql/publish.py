"""Statements for topics, groups and publishing."""

from __future__ import annotations

from functools import cache

from sqlalchemy import Integer, Interval, Text, any_, bindparam, cast, func, insert, select, true
from sqlalchemy.dialects.postgresql import JSONB, aggregate_order_by
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql import Executable

from pgq import schema as t


@cache
def create_topic() -> Executable:
    """Insert topic `:name` unless it exists."""
    return pg_insert(t.topic).values(name=bindparam("name")).on_conflict_do_nothing()


@cache
def lock_topic_for_subscribe() -> Executable:
    """The id of topic `:name`, locked FOR UPDATE: waits for publishers and retention
    (FOR KEY SHARE) that hold it, and makes later ones wait for this transaction.

    A statement of its own: the group insert and the backfill are later
    statements, so their snapshots are taken once every publisher and retention
    pass that held the lock has finished.
    """
    return select(t.topic.c.id).where(t.topic.c.name == bindparam("name")).with_for_update()


@cache
def topic_id() -> Executable:
    """The id of topic `:name` (on Citus, after the topic's advisory lock: a row lock
    on the reference table `topic` would lock every topic; decision 0023, 3.4)."""
    return select(t.topic.c.id).where(t.topic.c.name == bindparam("name"))


@cache
def insert_group() -> Executable:
    """Create group `:name` on topic `:topic_id` starting at `:start`; returns its id,
    nothing if it exists."""
    return (
        pg_insert(t.consumer_group)
        .values(name=bindparam("name"), topic_id=bindparam("topic_id"), start=bindparam("start"))
        .on_conflict_do_nothing(index_elements=["name"])
        .returning(t.consumer_group.c.id)
    )


@cache
def group_by_name() -> Executable:
    """Group `:name` with its topic's name."""
    g, tp = t.consumer_group, t.topic
    return (
        select(g.c.id, g.c.name, tp.c.name.label("topic"), tp.c.id.label("topic_id"))
        .join(tp, tp.c.id == g.c.topic_id)
        .where(g.c.name == bindparam("name"))
    )


@cache
def insert_breaker() -> Executable:
    """The group's breaker row, CLOSED at epoch 0."""
    return insert(t.breaker).values(group_id=bindparam("gid"))


@cache
def insert_group_state() -> Executable:
    """The group's state row: frontier at the start, totals 0."""
    return insert(t.group_state).values(group_id=bindparam("gid"))


@cache
def backfill_group() -> Executable:
    """One ready delivery row in group `:gid` for every retained message of `:topic_id`,
    claimable when the message is (a message published with `delay` keeps it).

    A message does not store its delay: its available time is on the rows the
    groups subscribed at publish got. No row is claimed before that time, so
    while it lies ahead every never-claimed row of the message (`lease_seq` 0)
    still carries it; once it has passed, the new row is available now. (A
    message published while its topic had no group has no such row: its delay
    is not known, and it is available at once.) The lookup reads only ready rows
    not due yet, through the ready index, not the backlog.

    Each row's xid is the subscribing transaction's (the column's default, or on
    Citus the trigger on the group's shard), in the xid space of the node that
    holds the row, as the frontier needs.

    Runs after `lock_topic_for_subscribe`, in a later statement.
    """
    m, d, g = t.message, t.delivery, t.consumer_group
    topic_id = bindparam("topic_id", type_=Integer)
    groups = select(g.c.id).where(g.c.topic_id == topic_id).scalar_subquery()
    due = (
        select(d.c.message_id, func.max(d.c.available_at).label("at"))
        .where(d.c.group_id == any_(func.array(groups)), d.c.state == t.READY)
        .where(d.c.available_at > func.now(), d.c.lease_seq == 0)
        .group_by(d.c.message_id)
        .cte("due")
    )
    return insert(d).from_select(
        ["group_id", "message_id", "available_at"],
        select(
            bindparam("gid", type_=Integer),
            m.c.id,
            func.coalesce(due.c.at, func.now()),
        )
        .select_from(m.outerjoin(due, due.c.message_id == m.c.id))
        .where(m.c.topic_id == topic_id),
    )


@cache
def lock_topic_for_publish() -> Executable:
    """Lock topic `:topic` FOR KEY SHARE for this transaction: publishers share it, a
    subscribe (FOR UPDATE) waits for it, and it waits for a subscribe holding it.

    A statement of its own, sent before `publish_batch` (pipelined, in the same
    round trip): a statement's snapshot is taken before it waits for a lock, so
    "lock, then write rows for the groups I see" in one statement misses a
    group whose subscribe committed during the wait. `publish_batch`, the next
    statement, takes its snapshot once the lock is held.
    """
    tp = t.topic
    return (
        select(tp.c.id)
        .where(tp.c.name == bindparam("topic"))
        .with_for_update(read=True, key_share=True)
    )


@cache
def publish_batch() -> Executable:
    """Publish the elements of `:payloads` (one JSON array, as text) to topic `:topic`
    in one statement (one parameter: PostgreSQL splits the array, not the driver).

    Runs after `lock_topic_for_publish` in the same transaction (that lock is why
    the groups it reads are all of them: a subscribe either committed before the
    lock was granted, and this statement's later snapshot sees its group, or it
    waits for this transaction and then backfills what it published). Inserts
    the messages in input order, one ready delivery row per subscribed group
    (its xid is the inserting transaction's on the node that holds it: the
    column's default, on Citus the trigger on the shard; not the message's,
    which on Citus is the coordinator's), and notifies `:channel`. Returns one
    row: the new ids in order (NULL when the topic does not exist).
    """
    tp, m, g, d = t.topic, t.message, t.consumer_group, t.delivery
    topic_row = select(tp.c.id).where(tp.c.name == bindparam("topic")).cte("topic_row")
    src = (
        func.jsonb_array_elements(cast(bindparam("payloads", type_=Text), JSONB))
        .table_valued("value", with_ordinality="ord")
        .render_derived()
    )
    new_messages = (
        insert(m)
        .from_select(
            ["topic_id", "key", "payload", "headers"],
            select(
                topic_row.c.id,
                bindparam("key", type_=Text),
                src.c.value,
                cast(bindparam("headers", type_=Text), JSONB),
            )
            .select_from(topic_row.join(src, true()))
            .order_by(src.c.ord),
        )
        .returning(m.c.id)
        .cte("new_messages")
    )
    deliveries = insert(d).from_select(
        ["group_id", "message_id", "available_at"],
        select(
            g.c.id,
            new_messages.c.id,
            func.now() + bindparam("delay", type_=Interval),
        )
        .select_from(new_messages.join(g, true()))
        .where(g.c.topic_id == select(topic_row.c.id).scalar_subquery()),
    )
    return (
        select(
            func.array_agg(aggregate_order_by(new_messages.c.id, new_messages.c.id)).label("ids"),
            func.pg_notify(bindparam("channel"), bindparam("topic")).label("notified"),
        )
        .select_from(new_messages)
        .add_cte(deliveries.cte("deliveries"))
    )


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel publishers in `schema` notify (payload: the topic)."""
    return f"pgq.{schema}"
