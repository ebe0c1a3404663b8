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
    null,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import ColumnElement, Executable

from pgq import schema as t
from pgq.records import AttemptEvent, ErrorClass
from pgq.sql import history
from pgq.sql.frontier import SPACE
from pgq.sql.refunds import charged_within

d, m = t.delivery, t.message


def held_by(owner: ColumnElement[bool]) -> ColumnElement[bool]:
    """Rows of `:gid` named by `:ids` whose lease owner is as `owner` says:
    `message_id = ANY(:ids)` makes the plan a primary-key lookup per named row,
    whatever else the statement joins."""
    return and_(
        d.c.group_id == bindparam("gid"),
        d.c.message_id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
        owner,
    )


def named_leases() -> Any:
    """`unnest(:ids, :seqs)` as rows (message_id, seq): the leases a statement names,
    each message with its own token."""
    return (
        func.unnest(
            bindparam("ids", type_=ARRAY(BigInteger)),
            bindparam("seqs", type_=ARRAY(BigInteger)),
        )
        .table_valued("message_id", "seq")
        .render_derived()
    )


def pairwise() -> ColumnElement[bool]:
    """The row's (message_id, lease_seq) is one of the pairs of `:ids`/`:seqs`.

    A claim gives all its rows one token, so the same token is current on several
    rows: `lease_seq = ANY(:seqs)` would let a stale outcome (X, t1) pass against a
    newer lease (X, t2) of the same member whenever another row of the batch came
    with X in claim t2. So each id is matched with its own token.

    `IS TRUE` keeps the test a filter on the primary-key lookups of `held_by`, with
    the pairs in a hash built once per statement (`hashed SubPlan`): as a bare
    `IN` PostgreSQL makes it a semi-join, and for 100-row batches it chose a nested
    loop comparing every row with every pair (O(batch²), measured 0.69 ms against
    0.25 ms hashed; `lease_seq = ANY(:seqs)` was 0.65 ms, a scan of the array per
    row)."""
    leases = named_leases()
    pairs = select(leases.c.message_id, leases.c.seq)
    return tuple_(d.c.message_id, d.c.lease_seq).in_(pairs).is_(true())


def fenced() -> ColumnElement[bool]:
    """Rows of `:gid` whose lease is still one of the pairs `:ids`/`:seqs` held by
    `:member`: the lease fence (decision 0004)."""
    return and_(held_by(d.c.lease_owner == bindparam("member")), pairwise())


@cache
def claim(limit: int, bodies: bool = True, ordered: bool = False) -> Executable:
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
    `bodies`: see `lease_picked`. In an `ordered` group, only rows whose key is
    free (`key_free`).
    """
    return lease_picked(ready_pick(limit, ordered), bodies)


def key_free(max_refunds: bool = False) -> ColumnElement[bool]:
    """The row may be leased in an ordered group (DESIGN §7, decision 0044): it has no
    key, or no row of its key is leased and none before it in frontier order is
    unresolved: ready (due or waiting for a retry) or leased, or dead of an outage
    whose close will refund it (`refund_pending`).

    "Before it" is only known once every transaction that could still insert a row
    before it has ended: its own xid is below the snapshot's xmin (the frontier's
    rule), and once the rows' xids count in this server's xid space (decision 0047:
    after a shard move, not before the group's frontier is rebased). Then each
    earlier row of the key is committed, so visible, or will never be. The tests
    read the key's partial indexes (`schema.key_order_index`,
    `schema.key_leased_index`), which hold only keyed rows: an unordered group's
    rows carry no key. "No leased row at all", not only none before it: a refund
    or a requeue that makes an earlier dead row ready again while a later one runs
    must not start the earlier one beside it.

    `max_refunds`: the statement binds `:max_refunds` (the probe's claim), and a dead
    row refunded that many times already, which no close refunds again, does not
    hold its key. Without it such a row held its key while the breaker was OPEN and
    nothing else could probe: the later message of its key was turned away, the
    dead row was past the refund cap, yet the later message counted as a candidate
    for `close_idle`, so the outage never closed. The worker's claim binds no cap
    (it claims nothing while OPEN; a close owes the cap-spent row nothing, so its
    reconciliation ends and frees the key).
    """
    before, leased = t.delivery.alias("before"), t.delivery.alias("leased_key")
    charged = before.c.refundable_attempts + before.c.refundable_reclaims > literal_column("0")
    earlier = _of_its_key(
        before,
        or_(
            before.c.state.in_([t.READY, t.LEASED]),
            and_(
                before.c.state == t.DEAD,
                charged,
                *refundable_again(before, max_refunds),
                refund_pending(before.c.error_epoch),
            ),
        ),
        tuple_(before.c.xid, before.c.message_id) < tuple_(d.c.xid, d.c.message_id),
    )
    running = _of_its_key(leased, leased.c.state == t.LEASED)
    # one lookup per statement (an InitPlan), not one snapshot copy per row
    xmin = select(func.pg_snapshot_xmin(func.pg_current_snapshot())).scalar_subquery()
    behind_xmin = d.c.xid < xmin
    # rows that came from another server (a shard move) order with this server's only
    # once the frontier is rebased (decision 0047): until then no keyed row is leased
    gs = t.group_state
    here = (
        select(literal(1))
        .where(gs.c.group_id == bindparam("gid"))
        .where(func.coalesce(gs.c.xid_space, SPACE) == SPACE)
        .exists()
    )
    # `running` first: a row behind a running one of its key (most rows a claim
    # passes over) is turned away by one probe of a hash built once per statement
    return or_(d.c.key.is_(None), and_(behind_xmin, here, ~running, ~earlier))


def _of_its_key(row: Any, *where: ColumnElement[bool]) -> ColumnElement[bool]:
    """A row `row` (an alias of `delivery`) of `:gid` with the claimed row's key exists,
    as `where` says (`key IS NOT NULL` spelled out: the key indexes' predicate)."""
    return (
        select(literal(1))
        .where(row.c.group_id == bindparam("gid"), row.c.key == d.c.key, row.c.key.is_not(None))
        .where(*where)
        .exists()
    )


def refundable_again(row: Any, max_refunds: bool) -> tuple[ColumnElement[bool], ...]:
    """With `max_refunds`, the test that `row` (an alias of delivery) was refunded
    fewer than `:max_refunds` times; without it, none."""
    if not max_refunds:
        return ()
    return (row.c.refunds < bindparam("max_refunds", type_=Integer),)


def refund_pending(error_epoch: ColumnElement[Any]) -> ColumnElement[bool]:
    """A close will refund a row charged at `error_epoch` (which carries charges): the
    group's breaker is OPEN, or a close owes a reconciliation of that epoch. Such a
    dead row still holds its key in an ordered group: it comes back, first."""
    br = t.breaker
    return (
        select(literal(1))
        .where(
            br.c.group_id == bindparam("gid"),
            or_(
                br.c.state == t.OPEN,
                and_(
                    error_epoch >= br.c.reconcile_from_epoch,
                    error_epoch < br.c.reconcile_epoch,
                ),
            ),
        )
        .exists()
    )


ORDERED_LOOKAHEAD = 1000
"""How many due rows, earliest first, a claim in an ordered group looks through for
rows whose key is free. Without a bound, a group whose backlog is a few keys
re-read the whole backlog at every claim (each row behind a running one of its key
fails `key_free`): 41 messages/s draining 5,000 messages of 10 keys. With it a key
whose next message lies further back waits until the rows before it are claimed
(decision 0044)."""


def ready_pick(limit: int, ordered: bool = False) -> Any:
    """The CTE `pick` of `claim`: up to `limit` ready rows of `:gid` it may lease; in an
    `ordered` group, among the first `ORDERED_LOOKAHEAD` due rows, those whose key is
    free (`key_free`)."""
    br = t.breaker
    group_open = (
        select(br.c.group_id).where(br.c.group_id == bindparam("gid"), br.c.state == t.OPEN)
    ).exists()
    owed_from, owed_to = (
        select(column).where(br.c.group_id == bindparam("gid")).scalar_subquery()
        for column in (br.c.reconcile_from_epoch, br.c.reconcile_epoch)
    )
    owed = charged_within(owed_from, owed_to)
    due: tuple[ColumnElement[bool], ...] = (
        d.c.group_id == bindparam("gid"),
        d.c.state == t.READY,
        d.c.available_at <= func.now(),
    )
    if ordered:
        # the window's end, one scan of the ready index (an InitPlan): so the claim's
        # own scan stops there, and where it finds its rows early, earlier
        # (by position, not time alone: a batch's rows share their available time)
        last_at, last_id = (
            select(column)
            .where(*due)
            .order_by(d.c.available_at, d.c.message_id)
            .offset(literal_column(str(ORDERED_LOOKAHEAD - 1)))
            .limit(literal_column("1"))
            .scalar_subquery()
            for column in (d.c.available_at, d.c.message_id)
        )
        within = tuple_(d.c.available_at, d.c.message_id) <= tuple_(
            func.coalesce(last_at, literal_column("'infinity'")),
            func.coalesce(last_id, literal_column(str(2**63 - 1))),
        )
        due = (*due, within, key_free())
    return (
        select(d.c.message_id)
        .where(*due, ~group_open, ~func.coalesce(owed, False))
        .order_by(d.c.available_at, d.c.message_id)
        .limit(literal_column(str(int(limit))))
        .with_for_update(skip_locked=True)
        .cte("pick")
    )


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


@cache
def token_block() -> Executable:
    """A new block of lease tokens for a member (`pgq.store.scope.LeaseTokens`)."""
    return select(t.lease_token.next_value())


@cache
def topic_of_group() -> Executable:
    """The topic id of group `:gid`."""
    g = t.consumer_group
    return select(g.c.topic_id).where(g.c.id == bindparam("gid", type_=Integer))


LEASED = ("message_id", "lease_seq", "attempts", "epoch")
"""The columns of a claim without its messages (`lease_picked(..., bodies=False)`)."""


@cache
def message_bodies() -> Executable:
    """The messages `:ids` of topic `:topic_id`: id, then what `CLAIMED` takes from a
    message. The second statement of a claim on Citus (`lease_picked`), routed to
    the topic's shard by `:topic_id`."""
    return select(m.c.id, *_body_columns()).where(
        m.c.topic_id == bindparam("topic_id", type_=Integer),
        m.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
    )


def leasing(pick: Any) -> Any:
    """The CTE `leased`: the rows of `pick` leased to `:member` for `:lease` under the
    claim's token `:token` (the member's, decision 0004: negative, never used by
    another claim). Bound, not `nextval()` here: Citus refuses a VOLATILE function
    in an UPDATE of a distributed table (0023, section 6). Returns message_id,
    lease_seq, attempts."""
    return (
        update(d)
        .where(d.c.group_id == bindparam("gid"), d.c.message_id == pick.c.message_id)
        .values(
            state=t.LEASED,
            lease_owner=bindparam("member"),
            lease_seq=bindparam("token", type_=BigInteger),
            lease_expires_at=func.now() + bindparam("lease", type_=Interval),
            updated_at=func.now(),
        )
        .returning(d.c.message_id, d.c.lease_seq, d.c.attempts)
        .cte("leased")
    )


def _body_columns() -> tuple[Any, ...]:
    """A message's key, payload, headers and creation time, as a claim returns them.
    Payload and headers come as text: json.loads on str is the C fast path (the
    driver's jsonb loader decodes bytes through the slower pure-Python path)."""
    return (
        m.c.key,
        cast(m.c.payload, Text).label("payload"),
        cast(m.c.headers, Text).label("headers"),
        m.c.created_at,
    )


def lease_picked(pick: Any, bodies: bool = True) -> Executable:
    """Lease the rows of the CTE `pick` (a `message_id` column) to `:member` for `:lease`.

    Gives the rows the claim's `:token` (`leasing`), so every claim is a new fence;
    returns the rows with their messages, as `CLAIMED` names them. Each message is
    looked up by its key, row by row (`OFFSET 0` keeps the planner from turning the
    lookups into a scan of the whole message table: measured 3.5 of 8.2 ms per
    100-row claim at a 20,000 backlog on PostgreSQL 15).

    Without `bodies` the rows come without their messages (`LEASED` names the
    columns), for `message_bodies` to read next: on Citus a group's rows and its
    topic's messages are on different shards, and a statement joining them is not
    routed to one node (0023, section 4).
    """
    leased = leasing(pick)
    if not bodies:
        leases = (leased.c.message_id, leased.c.lease_seq, leased.c.attempts)
        return select(*leases, _epoch().label("epoch"))
    body = (
        select(*_body_columns())
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
    """Push the expiry of the leases `:ids`/`:seqs` still held by `:member` to now +
    `:lease`, skipping rows another session holds a lock on: one row locked by an
    outside transaction (an operator's open `FOR UPDATE`) made the whole statement
    wait for its lock until `lock_timeout` and fail, every period, and the leases of
    the member's other rows, handlers still running, expired (reclaimed and run
    twice). A skipped row is tried again at the next period."""
    held = select(d.c.message_id).where(fenced()).with_for_update(skip_locked=True).cte("held")
    return (
        update(d)
        .where(d.c.group_id == bindparam("gid"), d.c.message_id == held.c.message_id)
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
def postpone() -> Executable:
    """Put the leases `:ids`/`:seqs` held by `:member` back to ready, due in `:delay`,
    uncharged: their messages are not visible yet. On Citus a publish commits node
    by node, so a group's row can be visible before its message is on the topic's
    node (tests/citus/test_two_phase.py)."""
    return (
        update(d)
        .where(fenced())
        .values(
            state=t.READY,
            lease_owner=None,
            lease_expires_at=None,
            available_at=func.now() + bindparam("delay", type_=Interval),
            updated_at=func.now(),
        )
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
    so no close brings it back. Each writes a line of the message's history: the
    member whose lease expired, and the group's epoch. Returns the reclaimed rows'
    ids and new state.

    Every subquery filters its table by `:gid`, never by a correlation on the
    row's group: Citus routes a statement to one shard only when each
    distributed table in it is filtered by the same value (0023, 3.2).
    """
    br, mb = t.breaker, t.member
    expired = (
        select(d.c.message_id, d.c.lease_owner)
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
    reclaimed = (
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
            error_class=case((dies, ErrorClass.LEASE.value), else_=d.c.error_class),
            last_error=case(
                (dies, "lease expired without an outcome too often"), else_=d.c.last_error
            ),
            error_epoch=case((or_(dies, refundable), epoch), else_=d.c.error_epoch),
            events=d.c.events + 1,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(
            d.c.message_id,
            d.c.state,
            d.c.events,
            d.c.attempts,
            d.c.reclaims,
            d.c.refunds,
            d.c.error_class,
            d.c.last_error,
            expired.c.lease_owner,
        )
        .cte("reclaimed")
    )
    r = reclaimed.c
    dead = r.state == t.DEAD
    written = history.written_by(
        reclaimed,
        {
            "event": case((dead, AttemptEvent.DIED.value), else_=AttemptEvent.RECLAIMED.value),
            "member": r.lease_owner,
            "seconds": null(),
            "error_class": case((dead, r.error_class)),
            "error": case((dead, r.last_error)),
            "epoch": epoch,
            "attempts": r.attempts,
            "reclaims": r.reclaims,
            "refunds": r.refunds,
        },
    )
    return select(r.message_id, r.state).add_cte(written)


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
