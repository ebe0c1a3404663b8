"""Read-only statements behind `pgq status`, `members`, `breaker` and `dead`.

Every statement reads one group by id (`:group_id`) or every group at once;
nothing here writes. Liveness and ages are computed with the database clock.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    Text,
    and_,
    bindparam,
    case,
    cast,
    column,
    func,
    or_,
    select,
    table,
)
from sqlalchemy.sql import ColumnElement, Select

from pgq import schema as t
from pgq.records import BreakerState, ErrorClass, RowState
from pgq.sql.members import departed_at, member_live


def _count_columns() -> list[ColumnElement[Any]]:
    d = t.delivery
    return [
        func.count().filter(d.c.state == RowState.READY.value).label("ready"),
        func.count().filter(d.c.state == RowState.LEASED.value).label("leased"),
        func.count().filter(d.c.state == RowState.DONE.value).label("done"),
        func.count().filter(d.c.state == RowState.DEAD.value).label("dead"),
        func.count()
        .filter(
            and_(d.c.state == RowState.DEAD.value, d.c.error_class == ErrorClass.SYSTEMIC.value)
        )
        .label("dead_systemic"),
    ]


@cache
def group_counts() -> Select[Any]:
    """Delivery rows of group `:group_id` per state (ready includes rows waiting for retry)."""
    d = t.delivery
    return select(*_count_columns()).where(d.c.group_id == bindparam("group_id", type_=Integer))


@cache
def all_group_counts() -> Select[Any]:
    """`group_counts` for every group that has delivery rows, one row per `group_id`."""
    d = t.delivery
    return select(d.c.group_id, *_count_columns()).group_by(d.c.group_id)


def _groups() -> Select[Any]:
    g, gs, tp, b = t.consumer_group, t.group_state, t.topic, t.breaker
    return select(
        g.c.id,
        g.c.name,
        tp.c.name.label("topic"),
        g.c.created_at,
        gs.c.committed_id,
        # a group always has its state and breaker rows (one subscribed by an earlier
        # version during an upgrade may lack the state row); the fallbacks only keep
        # status total
        func.coalesce(gs.c.done_pruned, 0).label("done_pruned"),
        func.coalesce(gs.c.reclaimed_total, 0).label("reclaimed_total"),
        func.coalesce(gs.c.released_total, 0).label("released_total"),
        func.coalesce(gs.c.refunded_total, 0).label("refunded_total"),
        func.coalesce(b.c.state, BreakerState.CLOSED.value).label("breaker_state"),
        func.coalesce(b.c.since, g.c.created_at).label("breaker_since"),
        func.coalesce(b.c.epoch, 0).label("breaker_epoch"),
        b.c.next_probe_at.label("breaker_next_probe_at"),
        b.c.reconcile_epoch.label("breaker_reconcile_epoch"),
    ).select_from(
        g.join(tp, tp.c.id == g.c.topic_id)
        .outerjoin(gs, gs.c.group_id == g.c.id)
        .outerjoin(b, b.c.group_id == g.c.id)
    )


@cache
def oldest_ready() -> Select[Any]:
    """`age_s`: seconds the oldest row of group `:group_id` that is claimable now has
    been so; NULL when none is. Claimable now: ready with `available_at` passed
    (waiting since `available_at`), or leased with its lease run out (waiting since
    `lease_expires_at`: a member killed while it held rows leaves them leased, and
    with no live member to sweep them nothing else says they wait).

    One probe of `delivery_ready_idx` (group_id, available_at, message_id WHERE
    ready) and one of `delivery_leased_idx` (group_id, lease_expires_at WHERE
    leased): the planner rewrites each `min` into an index-only scan under a
    `LIMIT 1` whose index condition is the group and the bound, so the cost does
    not grow with the lag (`status` runs it once per group).
    """
    return select(oldest_ready_age(bindparam("group_id", type_=Integer)).label("age_s"))


def oldest_ready_age(gid: Any) -> ColumnElement[Any]:
    """`oldest_ready`'s age of group `gid` (a bind parameter) as an expression."""
    d = t.delivery
    ready_since = (
        select(func.min(d.c.available_at))
        .where(d.c.group_id == gid, d.c.state == t.READY)
        .where(d.c.available_at <= func.now())
        .scalar_subquery()
    )
    expired_since = (
        select(func.min(d.c.lease_expires_at))
        .where(d.c.group_id == gid, d.c.state == t.LEASED)
        .where(d.c.lease_expires_at <= func.now())
        .scalar_subquery()
    )
    waited = func.now() - func.least(ready_since, expired_since)
    return cast(func.extract("epoch", waited), Float)


@cache
def group_row() -> Select[Any]:
    """Group `:group_id`: frontier, running totals and its breaker row."""
    return _groups().where(t.consumer_group.c.id == bindparam("group_id", type_=Integer))


@cache
def all_group_rows() -> Select[Any]:
    """`group_row` for every group, by name."""
    return _groups().order_by(t.consumer_group.c.name)


def _seconds(name: str) -> ColumnElement[Any]:
    # make_interval(years, months, weeks, days, hours, mins, secs): `secs => :name`
    return func.make_interval(0, 0, 0, 0, 0, 0, bindparam(name, type_=Float))


def _members(every: bool) -> Select[Any]:
    m = t.member
    live = member_live(_seconds("ttl"))
    stmt = select(
        m.c.group_id,
        m.c.name,
        case((live, True), else_=False).label("live"),
        m.c.local_breaker,
        m.c.last_seen,
        m.c.host,
        m.c.pid,
        m.c.started_at,
        m.c.left_at,
    )
    if every:
        return stmt
    return stmt.where(or_(live, departed_at() > func.now() - _seconds("recent")))


@cache
def group_members(every: bool = False) -> Select[Any]:
    """Members of group `:group_id` by name; `live` when heard from within `:ttl` seconds.

    Only the live ones and those that departed within the last `:recent` seconds,
    unless `every`: then every member row (departed ones are forgotten after
    `breaker.member_retention`, see `pgq.sql.members.forget_departed`).
    """
    m = t.member
    return (
        _members(every)
        .where(m.c.group_id == bindparam("group_id", type_=Integer))
        .order_by(m.c.name)
    )


@cache
def all_members(every: bool = False) -> Select[Any]:
    """`group_members` for every group, by group and name."""
    m = t.member
    return _members(every).order_by(m.c.group_id, m.c.name)


@cache
def breaker_history() -> Select[Any]:
    """The last `:limit` breaker transitions of group `:group_id`, newest first."""
    h = t.breaker_history
    return (
        select(h.c.epoch, h.c.state, h.c.at, h.c.refunded, h.c.by_member)
        .where(h.c.group_id == bindparam("group_id", type_=Integer))
        .order_by(h.c.epoch.desc(), h.c.at.desc())
        .limit(bindparam("limit", type_=Integer))
    )


@cache
def probes() -> Select[Any]:
    """The newest `:limit` group probes of group `:group_id` with their outcomes, newest
    first (`probe_at_idx`)."""
    p = t.probe
    return (
        select(p.c.epoch, p.c.at, p.c.member, p.c.message_id, p.c.outcome, p.c.error_class)
        .where(p.c.group_id == bindparam("group_id", type_=Integer))
        .order_by(p.c.at.desc(), p.c.id.desc())
        .limit(bindparam("limit", type_=Integer))
    )


@cache
def dead_rows(by_class: bool = False) -> Select[Any]:
    """The first `:limit` dead rows of group `:group_id`, by message id; only those
    of error class `:error_class` when `by_class`."""
    d = t.delivery
    stmt = (
        select(
            d.c.message_id,
            d.c.attempts,
            d.c.reclaims,
            d.c.refunds,
            d.c.error_class,
            d.c.last_error.label("error"),
            d.c.updated_at,
        )
        .where(
            d.c.group_id == bindparam("group_id", type_=Integer), d.c.state == RowState.DEAD.value
        )
        .order_by(d.c.message_id)
        .limit(bindparam("limit", type_=Integer))
    )
    return stmt.where(d.c.error_class == bindparam("error_class")) if by_class else stmt


_activity = table(
    "pg_stat_activity",
    column("pid", Integer),
    column("leader_pid", Integer),
    column("datname", Text),
    column("usename", Text),
    column("application_name", Text),
    column("state", Text),
    column("xact_start"),
    column("backend_xid"),
    column("backend_xmin"),
    schema="pg_catalog",
)


@cache
def frontier_holder(excluding: str | None = None) -> Select[Any]:
    """The backend, in any database of the cluster, with the oldest open transaction id.

    The frontier only passes transactions older than the snapshot's xmin, which
    is the oldest transaction id still running anywhere in the cluster: so the
    holder is the backend with the oldest `backend_xid`. (A `backend_xmin` alone,
    a long read-only snapshot, holds vacuum back but not the frontier, and is
    only used to break ties.) This session and its parallel workers are left out.
    Sessions of other roles are visible only with `pg_read_all_stats`. Ages are
    in seconds since the holder's transaction started, by the database clock.
    `excluding`: an `application_name` left out too (on a Citus worker, the
    backends of the distributed read that asks).
    """
    a = _activity
    return (
        select(
            a.c.pid,
            cast(func.extract("epoch", func.clock_timestamp() - a.c.xact_start), Float).label(
                "age_s"
            ),
            a.c.state,
            a.c.datname,
            a.c.usename,
            a.c.application_name,
            func.age(a.c.backend_xid).label("xid_age"),
        )
        .where(
            a.c.backend_xid.is_not(None),
            func.coalesce(a.c.leader_pid, a.c.pid) != func.pg_backend_pid(),
            a.c.application_name.is_distinct_from(excluding),
        )
        .order_by(
            func.age(a.c.backend_xid).desc(),
            func.age(a.c.backend_xmin).desc().nulls_last(),
            a.c.xact_start,
        )
        .limit(1)
    )


def _in_state(state: RowState) -> Any:
    d = t.delivery
    return (
        select(func.count())
        .where(d.c.group_id == bindparam("gid", type_=Integer), d.c.state == state.value)
        .scalar_subquery()
    )


@cache
def group_lag() -> Select[Any]:
    """Group `:gid`'s messages not yet resolved (`lag`: ready + leased), each state
    counted through its partial index (a member's progress line reads it once a
    minute; `group_counts` reads every row of the group)."""
    return select(_in_state(RowState.READY) + _in_state(RowState.LEASED))
