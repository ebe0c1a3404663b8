"""Statements for the committed frontier, pruning and retention.

The frontier advances in (xid, id) commit order and only over transactions
older than the current snapshot's xmin, so it never passes a message whose
publishing transaction is still open. Each step reads only the rows it passes
(plus one), so its cost follows the change, not the table.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import BigInteger, Interval, bindparam, cast, exists, func, select, tuple_, update
from sqlalchemy.sql import ColumnElement, Executable
from sqlalchemy.sql.selectable import ScalarSelect

from pgq import schema as t

d, g, m = t.delivery, t.consumer_group, t.message


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
    """
    tp = t.topic
    return (
        select(tp.c.id)
        .where(tp.c.id == bindparam("topic_id"))
        .with_for_update(read=True, key_share=True)
    )


@cache
def delete_expired_messages() -> Executable:
    """Delete up to `:limit` messages of `:topic_id` older than `:retention` that no group
    still has a delivery row for (done and pruned in every group).

    Runs after `lock_topic_for_retention` in the same transaction.
    """
    still_held = exists().where(d.c.message_id == m.c.id, d.c.group_id == g.c.id)
    held_by_any = select(g.c.id).where(g.c.topic_id == bindparam("topic_id"), still_held).exists()
    victims = (
        select(m.c.id)
        .where(m.c.topic_id == bindparam("topic_id"))
        .where(m.c.created_at < func.now() - bindparam("retention", type_=Interval))
        .where(~held_by_any)
        .order_by(m.c.id)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)  # members expiring at once split the work
        .scalar_subquery()
    )
    return m.delete().where(m.c.id.in_(victims)).returning(m.c.id)
