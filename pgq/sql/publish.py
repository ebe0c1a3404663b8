"""Statements for topics, groups and publishing."""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Integer,
    Interval,
    Text,
    any_,
    bindparam,
    case,
    cast,
    func,
    insert,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, aggregate_order_by
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql import ColumnElement, Executable

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
        .values(
            name=bindparam("name"),
            topic_id=bindparam("topic_id"),
            start=bindparam("start"),
            ordered=bindparam("ordered"),
        )
        .on_conflict_do_nothing(index_elements=["name"])
        .returning(t.consumer_group.c.id)
    )


@cache
def group_by_name() -> Executable:
    """Group `:name` with its topic's name."""
    g, tp = t.consumer_group, t.topic
    return (
        select(g.c.id, g.c.name, tp.c.name.label("topic"), tp.c.id.label("topic_id"), g.c.ordered)
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


def ordered_key(ordered: ColumnElement[bool], key: ColumnElement[Any]) -> ColumnElement[Any]:
    """A delivery row's key: the message's in an ordered group, NULL in any other, so
    that only ordered groups' rows are in the key indexes (decision 0044)."""
    return case((ordered, key))


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
    ordered = select(g.c.ordered).where(g.c.id == bindparam("gid")).scalar_subquery()
    return insert(d).from_select(
        ["group_id", "message_id", "available_at", "key"],
        select(
            bindparam("gid", type_=Integer),
            m.c.id,
            func.coalesce(due.c.at, func.now()),
            ordered_key(ordered, m.c.key),
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
    return _publish(deduped=False)


@cache
def publish_batch_deduped() -> Executable:
    """`publish_batch` with a dedupe key per payload: `:dedupe_keys`, a JSON array as
    long as `:payloads` (null: no key), whose keys are distinct (the caller folds
    repeats of a key into its first position).

    A payload whose key a message of the topic already has (retained, or
    inserted by a transaction that commits while this waits for it) is not
    inserted, and gets no delivery rows: `ON CONFLICT DO NOTHING` on
    `message_dedupe_key_idx`. Returns one row: the ids inserted in order, their
    keys in the same order (null for a payload without one), and the topic's id
    (for `dedupe_lookup`); ids NULL when nothing was inserted, all NULL when the
    topic does not exist.

    The id of a message that was there already cannot come from this statement:
    a conflicting message committed while it waited is not in its snapshot (READ
    COMMITTED). `dedupe_lookup`, a later statement, reads it. A separate statement
    from `publish_batch` so that a publish without keys sends exactly what it
    sent before schema version 7 (decision 0040).
    """
    return _publish(deduped=True)


def _publish(*, deduped: bool) -> Executable:
    tp, m, g, d = t.topic, t.message, t.consumer_group, t.delivery
    topic_row = select(tp.c.id).where(tp.c.name == bindparam("topic")).cte("topic_row")
    src = (
        func.jsonb_array_elements(cast(bindparam("payloads", type_=Text), JSONB))
        .table_valued("value", with_ordinality="ord")
        .render_derived()
    )
    columns = ["topic_id", "key", "payload", "headers"]
    values = [
        topic_row.c.id,
        bindparam("key", type_=Text),
        src.c.value,
        cast(bindparam("headers", type_=Text), JSONB),
    ]
    source = topic_row.join(src, true())
    if deduped:
        keys = (
            func.jsonb_array_elements_text(cast(bindparam("dedupe_keys", type_=Text), JSONB))
            .table_valued("value", with_ordinality="ord")
            .render_derived(name="dedupe")
        )
        columns.append("dedupe_key")
        values.append(keys.c.value)
        source = source.join(keys, keys.c.ord == src.c.ord)
    rows = select(*values).select_from(source).order_by(src.c.ord)
    if deduped:
        new_messages = (
            pg_insert(m)
            .from_select(columns, rows)
            .on_conflict_do_nothing(
                index_elements=[m.c.topic_id, m.c.dedupe_key],
                index_where=m.c.dedupe_key.is_not(None),
            )
            .returning(m.c.id, m.c.dedupe_key)
            .cte("new_messages")
        )
    else:
        new_messages = insert(m).from_select(columns, rows).returning(m.c.id).cte("new_messages")
    deliveries = insert(d).from_select(
        ["group_id", "message_id", "available_at", "key"],
        select(
            g.c.id,
            new_messages.c.id,
            func.now() + bindparam("delay", type_=Interval),
            ordered_key(g.c.ordered, bindparam("key", type_=Text)),
        )
        .select_from(new_messages.join(g, true()))
        .where(g.c.topic_id == select(topic_row.c.id).scalar_subquery()),
    )
    ids = func.array_agg(aggregate_order_by(new_messages.c.id, new_messages.c.id)).label("ids")
    notified = func.pg_notify(bindparam("channel"), bindparam("topic")).label("notified")
    if not deduped:
        return select(ids, notified).select_from(new_messages).add_cte(deliveries.cte("deliveries"))
    # from the topic row, so that the row comes (with the topic's id) when nothing
    # was inserted; the notification only when something was
    agg = (
        select(
            ids,
            func.array_agg(aggregate_order_by(new_messages.c.dedupe_key, new_messages.c.id)).label(
                "dedupe_keys"
            ),
        )
        .select_from(new_messages)
        .subquery("agg")
    )
    return (
        select(
            agg.c.ids,
            agg.c.dedupe_keys,
            topic_row.c.id.label("topic_id"),
            case((agg.c.ids.is_not(None), notified)).label("notified"),
        )
        .select_from(topic_row.join(agg, true()))
        .add_cte(deliveries.cte("deliveries"))
    )


@cache
def dedupe_lookup() -> Executable:
    """The ids of the messages of topic `:topic_id` whose dedupe keys are among
    `:keys`: (dedupe_key, id) rows. A statement of its own, after
    `publish_batch_deduped`, so that its snapshot sees the messages that
    statement waited for (on Citus one task, the topic's shard)."""
    m = t.message
    return select(m.c.dedupe_key, m.c.id).where(
        m.c.topic_id == bindparam("topic_id", type_=Integer),
        m.c.dedupe_key == any_(bindparam("keys", type_=ARRAY(Text))),
        m.c.dedupe_key.is_not(None),
    )


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel publishers in `schema` notify (payload: the topic)."""
    return f"pgq.{schema}"
