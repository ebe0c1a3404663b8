"""Statements for the committed frontier, pruning and retention.

The frontier advances in (xid, id) commit order and only over transactions
older than the current snapshot's xmin, so it never passes a message whose
publishing transaction is still open. Each step reads only the rows it passes
(plus one), so its cost follows the change, not the table.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Interval,
    any_,
    bindparam,
    cast,
    func,
    literal_column,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql import ColumnElement, Executable
from sqlalchemy.sql.selectable import ScalarSelect

from pgq import schema as t

d, g, m = t.delivery, t.consumer_group, t.message

MAX_ID = literal_column(str(2**63 - 1), BigInteger)


def _xmin() -> ColumnElement[Any]:
    return func.pg_snapshot_xmin(func.pg_current_snapshot())


def _after_frontier() -> ColumnElement[bool]:
    """(xid, message_id) beyond `:cx`/`:cid` (group `:gid`)."""
    return tuple_(d.c.xid, d.c.message_id) > tuple_(
        cast(bindparam("cx"), t.XID8()), bindparam("cid", type_=BigInteger)
    )


@cache
def lock_group() -> Executable:
    """The frontier of group `:gid`, locked; nothing if another member is advancing it."""
    return (
        select(g.c.committed_xid, g.c.committed_id)
        .where(g.c.id == bindparam("gid"))
        .with_for_update(skip_locked=True)
    )


@cache
def first_unresolved() -> Executable:
    """The first ready or leased row past the frontier, among committed transactions."""
    return (
        select(d.c.xid, d.c.message_id)
        .where(d.c.group_id == bindparam("gid"), _after_frontier(), d.c.xid < _xmin())
        .where(d.c.state.in_([t.READY, t.LEASED]))
        .order_by(d.c.xid, d.c.message_id)
        .limit(1)
    )


@cache
def last_resolved() -> Executable:
    """The last row past the frontier and before `:ux`/`:uid`, among committed transactions."""
    before = tuple_(d.c.xid, d.c.message_id) < tuple_(
        cast(bindparam("ux"), t.XID8()), bindparam("uid", type_=BigInteger)
    )
    return (
        select(d.c.xid, d.c.message_id)
        .where(d.c.group_id == bindparam("gid"), _after_frontier(), d.c.xid < _xmin(), before)
        .order_by(d.c.xid.desc(), d.c.message_id.desc())
        .limit(1)
    )


@cache
def last_committed() -> Executable:
    """The last row past the frontier among committed transactions (no unresolved row)."""
    return (
        select(d.c.xid, d.c.message_id)
        .where(d.c.group_id == bindparam("gid"), _after_frontier(), d.c.xid < _xmin())
        .order_by(d.c.xid.desc(), d.c.message_id.desc())
        .limit(1)
    )


def _prune(*where: ColumnElement[bool]) -> ScalarSelect[int]:
    """Delete the done rows of `:gid` matching `where`; their count, as a subquery."""
    pruned = (
        d.delete()
        .where(d.c.group_id == bindparam("gid"), d.c.state == t.DONE, *where)
        .returning(d.c.message_id)
        .cte("pruned")
    )
    return select(func.count()).select_from(pruned).scalar_subquery()


@cache
def advance() -> Executable:
    """Move the frontier of `:gid` from `:cx`/`:cid` to `:nx`/`:nid`, pruning the done rows
    it passed; returns how many were pruned."""
    upto = tuple_(d.c.xid, d.c.message_id) <= tuple_(
        cast(bindparam("nx"), t.XID8()), bindparam("nid", type_=BigInteger)
    )
    count = _prune(_after_frontier(), upto)
    return (
        update(g)
        .where(g.c.id == bindparam("gid"))
        .values(
            committed_xid=cast(bindparam("nx"), t.XID8()),
            committed_id=bindparam("nid", type_=BigInteger),
            done_pruned=g.c.done_pruned + count,
        )
        .returning(count)
    )


@cache
def prune_behind() -> Executable:
    """Prune done rows anywhere behind the frontier of `:gid` (rows a requeue or a
    refund sent back behind it and that finished since); returns the count."""
    upto = tuple_(d.c.xid, d.c.message_id) <= tuple_(g.c.committed_xid, g.c.committed_id)
    count = _prune(g.c.id == d.c.group_id, g.c.committed_id.is_not(None), upto)
    return (
        update(g)
        .where(g.c.id == bindparam("gid"))
        .values(done_pruned=g.c.done_pruned + count)
        .returning(count)
    )


@cache
def lock_topic_for_retention() -> Executable:
    """Lock topic `:topic_id` FOR KEY SHARE for this transaction, before retention's
    delete (a statement of its own, so the delete's snapshot is taken once the lock
    is held).

    Publishers share the lock; a subscribe (FOR UPDATE) excludes it. So a
    subscribe that got there first has committed its backfilled rows before the
    delete looks for rows, and one that comes later waits for the delete to
    commit and backfills only the messages that are left: no delivery row is
    ever written for a message retention deleted.

    Also turns JIT compilation off for the rest of the transaction: the delete's
    estimated cost grows with the table (the planner cannot see that a batch
    stops early), and past `jit_above_cost` compiling it took 0.2-0.4 s of a
    statement that runs in about 1 ms when there is nothing to delete.
    """
    tp = t.topic
    return (
        select(tp.c.id, func.set_config("jit", "off", True))
        .where(tp.c.id == bindparam("topic_id"))
        .with_for_update(read=True, key_share=True)
    )


@cache
def delete_expired_messages() -> Executable:
    """Delete up to `:limit` messages of `:topic_id` older than `:retention` that no
    group of the topic still has a delivery row for; returns their ids.

    A group's row goes only when it is done and behind the group's frontier (the
    frontier's pruning deletes it and counts it in `done_pruned`), so a message
    without rows is one every group finished, or one that a group subscribed
    later with `start="latest"` never had. Any other row (ready, leased, dead,
    or done ahead of its frontier) keeps its message. Runs after
    `lock_topic_for_retention` in the same transaction.

    Shape, for a cost that follows the expired messages rather than the tables:
    candidates are read in id order only below the topic's first message that
    is still young (ids follow creation, so everything below it has expired; an
    old message above it, from a long transaction, waits for a later pass);
    each candidate costs one primary-key probe into `delivery` for the topic's
    groups (a per-row subplan: as an anti-join the planner may hash the whole
    delivery table, measured 0.3-0.5 s a batch at 220k rows against 0.05 s);
    members that expire at once skip each other's candidates (SKIP LOCKED).
    """
    cutoff = func.now() - bindparam("retention", type_=Interval)
    young = m.alias("young")
    first_young = (
        select(young.c.id)
        .where(young.c.topic_id == bindparam("topic_id"), young.c.created_at >= cutoff)
        .order_by(young.c.id)
        .limit(literal_column("1"))
        .scalar_subquery()
    )
    groups = select(g.c.id).where(g.c.topic_id == bindparam("topic_id")).scalar_subquery()
    held = (
        select(d.c.message_id)
        .where(d.c.group_id == any_(func.array(groups)), d.c.message_id == m.c.id)
        .correlate(m)
        .exists()
    )
    victims = (
        select(m.c.id)
        .where(m.c.topic_id == bindparam("topic_id"), m.c.created_at < cutoff)
        .where(m.c.id < func.coalesce(first_young, MAX_ID))
        .where(~select(held).scalar_subquery())
        .order_by(m.c.id)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return m.delete().where(m.c.id == any_(func.array(victims))).returning(m.c.id)
