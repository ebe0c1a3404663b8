"""A message's history in a group (`attempt`): written by the statements that make
it, read by `pgq.store.history`.

A statement that fails an attempt, reclaims an expired lease or refunds a row adds
`events + 1` to the rows it changes and returns what a line needs; `written_by`
turns that into one more CTE of the same statement, which writes the lines into
their slots (`HISTORY_SLOTS`, a ring: a slot's older line is overwritten, never
deleted). One statement: a line is written exactly when its change commits, and on
Citus the statement stays on the group's shard (every table in it filtered by
`:gid`; decision 0023).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Interval,
    bindparam,
    func,
    literal_column,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP, insert
from sqlalchemy.sql import ColumnElement, Executable
from sqlalchemy.sql.selectable import CTE

from pgq import schema as t

a = t.attempt

LINE_COLUMNS = (
    "event",
    "member",
    "seconds",
    "error_class",
    "error",
    "epoch",
    "attempts",
    "reclaims",
    "refunds",
)
"""The columns of a line a statement supplies (besides the row's id and `events`)."""


def written_by(changed: CTE, line: dict[str, ColumnElement[Any]]) -> CTE:
    """The CTE that writes a history line for each row of `changed` (which returns
    `message_id` and the row's new `events`); `line` gives each of `LINE_COLUMNS`
    as an expression over `changed`."""
    n = changed.c.events
    source = select(
        bindparam("gid", type_=Integer),
        changed.c.message_id,
        (n % literal_column(str(t.HISTORY_SLOTS))).label("slot"),
        n,
        *(line[name].label(name) for name in LINE_COLUMNS),
    )
    into = ("group_id", "message_id", "slot", "n", *LINE_COLUMNS)
    stmt = insert(a).from_select(list(into), source)
    excluded = stmt.excluded
    rewritten = {name: excluded[name] for name in ("n", "at", *LINE_COLUMNS)}
    return (
        stmt.on_conflict_do_update(index_elements=list(a.primary_key.columns), set_=rewritten)
        .returning(a.c.message_id)
        .cte("written")
    )


@cache
def lines() -> Executable:
    """The history lines of message `:message_id` in group `:gid`, oldest first."""
    return (
        select(
            a.c.n,
            a.c.at,
            a.c.event,
            a.c.member,
            a.c.seconds,
            a.c.error_class,
            a.c.error,
            a.c.epoch,
            a.c.attempts,
            a.c.reclaims,
            a.c.refunds,
        )
        .where(
            a.c.group_id == bindparam("gid", type_=Integer),
            a.c.message_id == bindparam("message_id", type_=BigInteger),
        )
        .order_by(a.c.n)
    )


@cache
def events_of() -> Executable:
    """How many lines message `:message_id`'s row in group `:gid` has written
    (`delivery.events`); no row once it is acked or purged."""
    d = t.delivery
    return select(d.c.events).where(
        d.c.group_id == bindparam("gid", type_=Integer),
        d.c.message_id == bindparam("message_id", type_=BigInteger),
    )


@cache
def probes_of() -> Executable:
    """The group probes of group `:gid` that took message `:message_id`, oldest first."""
    p = t.probe
    return (
        select(p.c.epoch, p.c.at, p.c.member, p.c.outcome, p.c.error_class)
        .where(
            p.c.group_id == bindparam("gid", type_=Integer),
            p.c.message_id == bindparam("message_id", type_=BigInteger),
        )
        .order_by(p.c.at, p.c.id)
    )


@cache
def transitions_since() -> Executable:
    """Group `:gid`'s breaker transitions from the one in force at `:since` (the
    last before it; every one when there is none) on, oldest first: the epochs a
    message published at `:since` lived through."""
    h = t.breaker_history
    gid = bindparam("gid", type_=Integer)
    in_force = (
        select(func.max(h.c.at))
        .where(h.c.group_id == gid, h.c.at <= bindparam("since", type_=TIMESTAMP(timezone=True)))
        .scalar_subquery()
    )
    return (
        select(h.c.epoch, h.c.state, h.c.at, h.c.refunded, h.c.by_member)
        .where(h.c.group_id == gid, h.c.at >= func.coalesce(in_force, h.c.at))
        .order_by(h.c.epoch, h.c.at)
    )


@cache
def delete_expired_lines() -> Executable:
    """Delete up to `:limit` of group `:gid`'s history lines older than `:retention`,
    oldest first; returns how many. A line is younger than its message, so retention
    has deleted (or is about to delete) the message of every line it takes."""
    cutoff = func.now() - bindparam("retention", type_=Interval)
    victims = (
        select(a.c.message_id, a.c.slot)
        .where(a.c.group_id == bindparam("gid", type_=Integer), a.c.at < cutoff)
        .order_by(a.c.at)
        .limit(bindparam("limit", type_=Integer))
        .cte("victims")
    )
    deleted = (
        a.delete()
        .where(
            a.c.group_id == bindparam("gid", type_=Integer),
            tuple_(a.c.message_id, a.c.slot).in_(select(victims.c.message_id, victims.c.slot)),
        )
        .returning(a.c.n)
        .cte("deleted")
    )
    return select(func.count()).select_from(deleted)
