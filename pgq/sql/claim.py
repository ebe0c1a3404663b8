"""Statements of the claim path: claim, extend, release, sweep expired leases."""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Interval,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    func,
    literal,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import ColumnElement, Executable

from pgq import schema as t
from pgq.sql.refunds import charged_within

d, m = t.delivery, t.message


def fenced() -> ColumnElement[bool]:
    """Rows of `:gid` named by `:ids` whose lease is still one of `:seqs` held by
    `:member`: the lease fence. Tokens are unique across rows and claims, so
    `lease_seq = ANY(:seqs)` matches exactly the leases named, and
    `message_id = ANY(:ids)` makes the plan a primary-key lookup per row."""
    return and_(
        d.c.group_id == bindparam("gid"),
        d.c.message_id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
        d.c.lease_seq == any_(bindparam("seqs", type_=ARRAY(BigInteger))),
        d.c.lease_owner == bindparam("member"),
    )


@cache
def claim(limit: int) -> Executable:
    """Lease up to `limit` ready rows of `:gid` to `:member` for `:lease`.

    `limit` is written into the statement, not bound: a prepared statement's
    generic plan with `LIMIT $n` assumes it returns a tenth of the table and
    picks a full scan (measured: 7.8 ms per claim at 20k rows, 293 ms at 1M).
    Callers use a handful of distinct limits (see `GroupStore.claim`).

    Skips rows other members hold locks on (never waits); earliest available
    first. Claims nothing while the group breaker is OPEN: the database is the
    last gate, so a member that has not heard of the open yet (it just started,
    its heartbeat is due) cannot take rows either; the prober's probe claim is
    separate. While a close still owes a reconciliation, skips the rows it owes a
    refund (charged within the owed epochs): run first, they would run at
    a high attempt number and could die early, and no later close would refund
    them. The reconciler makes them ready again, refunded, batch by batch.
    """
    br = t.breaker
    group_open = (
        select(br.c.group_id).where(br.c.group_id == bindparam("gid"), br.c.state == t.OPEN)
    ).exists()
    owed_from, owed_to = (
        select(column).where(br.c.group_id == bindparam("gid")).scalar_subquery()
        for column in (br.c.reconcile_from_epoch, br.c.reconcile_epoch)
    )
    owed = charged_within(owed_from, owed_to)
    pick = (
        select(d.c.message_id)
        .where(d.c.group_id == bindparam("gid"), d.c.state == t.READY)
        .where(d.c.available_at <= func.now(), ~group_open, ~func.coalesce(owed, False))
        .order_by(d.c.available_at, d.c.message_id)
        .limit(literal_column(str(int(limit))))
        .with_for_update(skip_locked=True)
        .cte("pick")
    )
    return lease_picked(pick)


def _epoch() -> ColumnElement[Any]:
    """The group breaker's epoch as the claim saw it (one lookup per statement): an
    attempt is filed under it, never under an older epoch the member's gate may still
    believe in (an outage that opened and closed between two of its heartbeats), so a
    failure after a close cannot fall into the window that close refunds."""
    br = t.breaker
    return select(br.c.epoch).where(br.c.group_id == bindparam("gid")).scalar_subquery()


CLAIMED = (
    *("message_id", "lease_seq", "attempts"),
    *("key", "payload", "headers", "created_at", "epoch"),
)
"""The names of the columns a claim returns, in order (the store maps rows by them)."""


def lease_picked(pick: Any) -> Executable:
    """Lease the rows of the CTE `pick` (a `message_id` column) to `:member` for `:lease`.

    Gives each row a fresh `lease_seq` token, so every claim is a new fence; returns
    the rows with their messages, as `CLAIMED` names them. Each message is looked up
    by its key, row by row (`OFFSET 0` keeps the planner from turning the lookups
    into a scan of the whole message table: measured 3.5 of 8.2 ms per 100-row claim
    at a 20,000 backlog on PostgreSQL 15). Payload and headers come as text:
    json.loads on str is the C fast path (the driver's jsonb loader decodes bytes
    through the slower pure-Python path).
    """
    leased = (
        update(d)
        .where(d.c.group_id == bindparam("gid"), d.c.message_id == pick.c.message_id)
        .values(
            state=t.LEASED,
            lease_owner=bindparam("member"),
            lease_seq=t.lease_token.next_value(),
            lease_expires_at=func.now() + bindparam("lease", type_=Interval),
            updated_at=func.now(),
        )
        .returning(d.c.message_id, d.c.lease_seq, d.c.attempts)
        .cte("leased")
    )
    body = (
        select(
            m.c.key,
            cast(m.c.payload, Text).label("payload"),
            cast(m.c.headers, Text).label("headers"),
            m.c.created_at,
        )
        .where(m.c.id == leased.c.message_id)
        .offset(literal_column("0"))
        .lateral("body")
    )
    columns = (
        leased.c.message_id,
        leased.c.lease_seq,
        leased.c.attempts,
        body.c.key,
        body.c.payload,
        body.c.headers,
        body.c.created_at,
        _epoch().label("epoch"),
    )
    return select(*columns).select_from(leased.join(body, true()))


@cache
def extend_leases() -> Executable:
    """Push the expiry of the leases `:ids`/`:seqs` still held by `:member` to now + `:lease`."""
    return (
        update(d)
        .where(fenced())
        .values(lease_expires_at=func.now() + bindparam("lease", type_=Interval))
        .returning(d.c.message_id, d.c.lease_seq)
    )


@cache
def release() -> Executable:
    """Put the unstarted leases `:ids`/`:seqs` back to ready: no attempt, no reclaim charged."""
    return (
        update(d)
        .where(fenced())
        .values(state=t.READY, lease_owner=None, lease_expires_at=None, updated_at=func.now())
        .returning(d.c.message_id, d.c.lease_seq)
    )


@cache
def sweep_expired() -> Executable:
    """Reclaim up to `:limit` rows of `:gid` whose lease expired without an outcome.

    Each goes back to ready (`reclaims` + 1), or dead with class `lease` past
    `:max_reclaims`. The reclaim is refundable when the group's breaker was
    open, the holder's local breaker was open, or the row's last failure was
    systemic: it is then charged under the current epoch (`error_epoch`), so
    the close of that outage refunds it, dead or not. A row that dies of a
    reclaim that was not refundable died for itself: its charges are dropped,
    so no close brings it back. Returns the reclaimed rows' ids and new state.

    Every subquery filters its table by `:gid`, never by a correlation on the
    row's group: Citus routes a statement to one shard only when each
    distributed table in it is filtered by the same value (0023, 3.2).
    """
    br, mb = t.breaker, t.member
    expired = (
        select(d.c.message_id)
        .where(
            d.c.group_id == bindparam("gid"),
            d.c.state == t.LEASED,
            d.c.lease_expires_at < func.now(),
        )
        .order_by(d.c.lease_expires_at)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    group_open = (
        select(literal(True))
        .where(br.c.group_id == bindparam("gid"), br.c.state == t.OPEN)
        .exists()
    )
    holder_open = (
        select(literal(True))
        .where(
            mb.c.group_id == bindparam("gid"),
            mb.c.name == d.c.lease_owner,
            mb.c.local_breaker == t.LOCAL_OPEN,
        )
        .exists()
    )
    last_systemic = func.coalesce(d.c.error_class == t.SYSTEMIC, False)  # never NULL
    refundable = or_(group_open, holder_open, last_systemic)
    dies = d.c.reclaims + 1 > bindparam("max_reclaims", type_=Integer)
    forfeits = and_(dies, ~refundable)
    epoch = select(br.c.epoch).where(br.c.group_id == bindparam("gid")).scalar_subquery()
    return (
        update(d)
        .where(d.c.group_id == bindparam("gid"), d.c.message_id == expired.c.message_id)
        .values(
            state=case((dies, t.DEAD), else_=t.READY),
            reclaims=d.c.reclaims + 1,
            refundable_attempts=case((forfeits, 0), else_=d.c.refundable_attempts),
            refundable_reclaims=case(
                (forfeits, 0),
                (refundable, d.c.refundable_reclaims + 1),
                else_=d.c.refundable_reclaims,
            ),
            error_class=case((dies, "lease"), else_=d.c.error_class),
            last_error=case(
                (dies, "lease expired without an outcome too often"), else_=d.c.last_error
            ),
            error_epoch=case((or_(dies, refundable), epoch), else_=d.c.error_epoch),
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(d.c.message_id, d.c.state)
    )


@cache
def add_to_total(total: str) -> Executable:
    """Add `:n` to the group's running counter `total` (`released_total`, `reclaimed_total`)."""
    gs = t.group_state
    column = gs.c[total]
    return (
        update(gs)
        .where(gs.c.group_id == bindparam("gid"))
        .values({column: column + bindparam("n", type_=BigInteger)})
    )
