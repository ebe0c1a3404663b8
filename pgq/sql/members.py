"""Statements for group membership: join, heartbeat, leave, and the drain check."""

from __future__ import annotations

from functools import cache

from sqlalchemy import Integer, Interval, and_, bindparam, func, literal_column, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql import ColumnElement, Executable

from pgq import schema as t

mb, d, br = t.member, t.delivery, t.breaker


def _live() -> ColumnElement[bool]:
    """A member row is live: not left, seen within `:ttl`."""
    return and_(
        mb.c.left_at.is_(None), mb.c.last_seen > func.now() - bindparam("ttl", type_=Interval)
    )


@cache
def join() -> Executable:
    """Register `:member` in `:gid` unless a live member already has that name.

    One statement, so two processes starting with the same name cannot both
    win. Returns the name when joined, nothing when refused.
    """
    stmt = pg_insert(mb).values(
        group_id=bindparam("gid"),
        name=bindparam("member"),
        host=bindparam("host"),
        pid=bindparam("pid"),
    )
    return stmt.on_conflict_do_update(
        index_elements=[mb.c.group_id, mb.c.name],
        set_={
            "host": stmt.excluded.host,
            "pid": stmt.excluded.pid,
            "started_at": func.now(),
            "last_seen": func.now(),
            "left_at": None,
            "local_breaker": literal_column("'closed'"),
            "tripped_epoch": None,
        },
        where=~_live(),
    ).returning(mb.c.name)


@cache
def heartbeat() -> Executable:
    """Record that `:member` is alive, with its local breaker `:local` (tripped under
    `:tripped_epoch`); returns the group breaker's state and epoch."""
    return (
        update(mb)
        .where(mb.c.group_id == bindparam("gid"), mb.c.name == bindparam("member"))
        .values(
            last_seen=func.now(),
            left_at=None,
            local_breaker=bindparam("local"),
            tripped_epoch=bindparam("tripped_epoch", type_=Integer),
        )
        .returning(
            select(br.c.state)
            .where(br.c.group_id == mb.c.group_id)
            .scalar_subquery()
            .label("state"),
            select(br.c.epoch)
            .where(br.c.group_id == mb.c.group_id)
            .scalar_subquery()
            .label("epoch"),
        )
    )


@cache
def leave() -> Executable:
    """Mark `:member` as gone from `:gid`."""
    return (
        update(mb)
        .where(mb.c.group_id == bindparam("gid"), mb.c.name == bindparam("member"))
        .values(left_at=func.now(), local_breaker=literal_column("'closed'"))
    )


@cache
def drain_state() -> Executable:
    """What stands between `:member` and an empty group `:gid`.

    Returns (ready now, waiting for a later retry, leased by this member or by
    members that are not live — rows whose leases must expire and be reclaimed).
    """
    holder_live = (
        select(mb.c.name)
        .where(mb.c.group_id == d.c.group_id, mb.c.name == d.c.lease_owner, _live())
        .exists()
    )
    ready = d.c.state == t.READY
    return select(
        func.count().filter(and_(ready, d.c.available_at <= func.now())).label("ready_now"),
        func.count().filter(and_(ready, d.c.available_at > func.now())).label("waiting_retry"),
        func.count()
        .filter(
            and_(d.c.state == t.LEASED, (d.c.lease_owner == bindparam("member")) | ~holder_live)
        )
        .label("held"),
    ).where(d.c.group_id == bindparam("gid"), d.c.state.in_([t.READY, t.LEASED]))
