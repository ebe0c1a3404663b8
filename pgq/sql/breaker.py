"""Statements of the group circuit breaker: open on quorum, probe, close, reconcile.

Persisted state is CLOSED or OPEN plus an epoch that every transition bumps.
Every transition is one conditional statement on the epoch the caller saw, so
two members cannot both flip it, and a prober from an older outage (or one
that lost its lock) cannot close a newer one.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Interval,
    Numeric,
    Text,
    and_,
    bindparam,
    case,
    cast,
    false,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.sql import ColumnElement, Executable

from pgq import schema as t
from pgq.records import AttemptEvent
from pgq.sql import history
from pgq.sql.claim import key_free, lease_picked
from pgq.sql.locks import advisory_held
from pgq.sql.members import member_key, member_live
from pgq.sql.refunds import carries_charges, charged_within

br, hist, mb, d, gs = t.breaker, t.breaker_history, t.member, t.delivery, t.group_state
pr = t.probe


def _live_members() -> ColumnElement[bool]:
    return and_(mb.c.group_id == bindparam("gid"), member_live())


def _open_at_epoch() -> ColumnElement[bool]:
    """The group `:gid` is still OPEN at `:at_epoch` (the epoch the caller probed under)."""
    return and_(
        br.c.group_id == bindparam("gid"),
        br.c.state == t.OPEN,
        br.c.epoch == bindparam("at_epoch", type_=Integer),
    )


def _recorded(flipped: Any, state: Any) -> Executable:
    """Insert the history row of a transition made by the CTE `flipped`; returns its epoch."""
    return (
        insert(hist)
        .from_select(
            ["group_id", "epoch", "state", "by_member"],
            select(flipped.c.group_id, flipped.c.epoch, state, bindparam("member")),
        )
        .returning(hist.c.epoch)
    )


def _probe_logged(moved: Any, outcome: Any, error_class: Any) -> Any:
    """A CTE that logs the probe of the OPEN epoch `:at_epoch` by `:member` on message
    `:probe_id` with `outcome`, once per row the breaker update `moved` (a CTE that
    returns `group_id`) matched: nothing when the group moved on meanwhile. In the
    outcome's own statement, so the log costs no round trip and never disagrees
    with the breaker row."""
    return (
        insert(pr)
        .from_select(
            ["group_id", "epoch", "member", "message_id", "outcome", "error_class"],
            select(
                moved.c.group_id,
                bindparam("at_epoch", type_=Integer),
                bindparam("member", type_=Text),
                bindparam("probe_id", type_=BigInteger),
                outcome,
                error_class,
            ),
        )
        .cte("logged")
    )


@cache
def state() -> Executable:
    """The group breaker: state, epoch, next probe due (bool), reconciliation owed."""
    return select(
        br.c.state,
        br.c.epoch,
        func.coalesce(br.c.next_probe_at <= func.now(), True).label("probe_due"),
        br.c.reconcile_epoch,
        br.c.reconcile_from_epoch.label("reconcile_from"),
        br.c.probe_failures,
    ).where(br.c.group_id == bindparam("gid"))


@cache
def open_on_quorum() -> Executable:
    """Flip `:gid` from CLOSED at `:at_epoch` to OPEN when enough live members tripped.

    Tripped live members (under the current epoch) must number at least
    `max(:min_members, ceil(:quorum × live))`. The check and the flip are one
    statement; returns the new epoch when this call opened the group.
    """
    live = select(func.count()).where(_live_members()).scalar_subquery()
    tripped = (
        select(func.count())
        .where(
            _live_members(), mb.c.local_breaker == t.LOCAL_OPEN, mb.c.tripped_epoch == br.c.epoch
        )
        .scalar_subquery()
    )
    needed = func.greatest(
        bindparam("min_members", type_=Integer),
        func.ceil(cast(bindparam("quorum"), Numeric) * live),
    )
    flipped = (
        update(br)
        .where(
            br.c.group_id == bindparam("gid"),
            br.c.state == t.CLOSED,
            br.c.epoch == bindparam("at_epoch", type_=Integer),
            tripped >= needed,
            tripped > 0,
        )
        .values(
            state=t.OPEN,
            epoch=br.c.epoch + 1,
            since=func.now(),
            next_probe_at=func.now(),
            probe_failures=0,
            prober=None,
        )
        .returning(br.c.group_id, br.c.epoch)
        .cte("flipped")
    )
    return _recorded(flipped, t.OPEN)


@cache
def set_prober() -> Executable:
    """Record `:member` as the prober of `:gid` (the last one elected, for the record)."""
    return (
        update(br)
        .where(br.c.group_id == bindparam("gid"), br.c.state == t.OPEN)
        .values(prober=bindparam("member"))
    )


@cache
def mark_prober() -> Executable:
    """Take `:member`'s prober lock in `:gid` in this session, unless it holds it
    already (the member's session outlives elections: a second take would stack a
    second hold that one unlock leaves in place). Run on the session that holds the
    probe lock, it names the prober for as long as that session lives or until
    `unmark_prober`. Over no table, so on Citus it runs on the coordinator with the
    session's other locks."""
    key = _prober_key()
    return select(
        case((advisory_held(key, this_session=True), true()), else_=func.pg_try_advisory_lock(key))
    )


@cache
def unmark_prober() -> Executable:
    """Release `:member`'s prober lock in `:gid` if this session holds it (the prober
    stepped down; its session, shared with the member's liveness, goes on)."""
    key = _prober_key()
    return select(
        case((advisory_held(key, this_session=True), func.pg_advisory_unlock(key)), else_=false())
    )


def _prober_key() -> ColumnElement[int]:
    return member_key(bindparam("gid", type_=Integer), bindparam("member", type_=Text), "prober")


@cache
def probe_slot() -> Executable:
    """Lock `:gid`'s breaker row if it is OPEN at `:at_epoch` and a probe may start: the
    next probe time has come (the backoff after the last probe's outcome, or the end
    of the slot a probe in flight reserved and its prober stopped renewing).

    The probe claim runs in the same transaction and then `reserve_probe`s the slot,
    so of two probers (one that lost its lock mid-probe and its successor) only one
    probe is in flight: the other waits for the first one's outcome.
    """
    due = func.coalesce(br.c.next_probe_at <= func.now(), True)
    return select(br.c.group_id).where(_open_at_epoch(), due).with_for_update(of=br)


@cache
def reserve_probe() -> Executable:
    """A probe of `:gid` started (or still runs): no other until now + `:hold`, unless
    its outcome sets the next probe time first. The prober renews the slot while the
    handler runs, so a prober that dies or stops answering frees it within `:hold`."""
    return (
        update(br)
        .where(_open_at_epoch())
        .values(next_probe_at=func.now() + bindparam("hold", type_=Interval))
    )


@cache
def probe_failed() -> Executable:
    """A probe of the OPEN epoch `:at_epoch` failed systemically: back off to now + `:delay`,
    and log it (`:member`, `:probe_id`) as `failed`. Returns the failures in a row."""
    failed = (
        update(br)
        .where(_open_at_epoch())
        .values(
            probe_failures=br.c.probe_failures + 1,
            next_probe_at=func.now() + bindparam("delay", type_=Interval),
        )
        .returning(br.c.group_id, br.c.probe_failures)
        .cte("failed")
    )
    logged = _probe_logged(failed, literal_column("'failed'", Text), t.SYSTEMIC)
    return select(failed.c.probe_failures).add_cte(logged)


@cache
def probe_again(logged: bool = False) -> Executable:
    """The next probe of the OPEN epoch `:at_epoch` is due at now + `:delay`, the failure
    count kept: after an inconclusive probe (message, permanent, a snooze: nothing
    learnt about the dependency, but the next probe still waits the current interval),
    or with `:delay` 0 to free the slot a probe reserved.

    `logged`: the probe is logged too (`:member`, `:probe_id`, `:outcome`,
    `:error_class`): an inconclusive probe, or a success whose prober lost its lock
    (it frees the slot instead of closing). Freeing a slot alone logs nothing.
    Returns the failures in a row.
    """
    again = (
        update(br)
        .where(_open_at_epoch())
        .values(next_probe_at=func.now() + bindparam("delay", type_=Interval))
        .returning(br.c.group_id, br.c.probe_failures)
    )
    if not logged:
        return again
    moved = again.cte("again")
    logged_cte = _probe_logged(
        moved, bindparam("outcome", type_=Text), bindparam("error_class", type_=Text)
    )
    return select(moved.c.probe_failures).add_cte(logged_cte)


def _closed() -> dict[str, Any]:
    """What every close writes to the breaker row: CLOSED under the next epoch, no
    probe pending, no prober."""
    return {
        "state": t.CLOSED,
        "epoch": br.c.epoch + 1,
        "since": func.now(),
        "next_probe_at": None,
        "probe_failures": 0,
        "prober": None,
    }


@cache
def close() -> Executable:
    """Close `:gid` if it is still OPEN at `:at_epoch`; owe a reconciliation for the new epoch.

    The probe that succeeded (`:member`, `:probe_id`) is logged in the same statement.
    Returns the new (close) epoch, nothing when the group moved on meanwhile.
    """
    flipped = (
        update(br)
        .where(_open_at_epoch())
        .values(
            **_closed(),
            reconcile_epoch=br.c.epoch + 1,
            # rows that failed since the previous close (epoch - 1) are refunded, and
            # whatever an unfinished earlier reconciliation still owed
            reconcile_from_epoch=case(
                (br.c.reconcile_epoch.is_(None), br.c.epoch - 1),
                else_=func.least(br.c.reconcile_from_epoch, br.c.epoch - 1),
            ),
        )
        .returning(br.c.group_id, br.c.epoch)
        .cte("flipped")
    )
    logged = _probe_logged(flipped, literal_column("'succeeded'", Text), null())
    # the probe's own refund (`:refunded` rows, written in the same transaction)
    return (
        insert(hist)
        .from_select(
            ["group_id", "epoch", "state", "by_member", "refunded"],
            select(
                flipped.c.group_id,
                flipped.c.epoch,
                t.CLOSED,
                bindparam("member"),
                bindparam("refunded", type_=BigInteger),
            ),
        )
        .returning(hist.c.epoch)
        .add_cte(logged)
    )


@cache
def close_idle() -> Executable:
    """Close `:gid` if it is OPEN at `:at_epoch`, no probe is in flight (the probe time
    has come) and no row of the group is a probe candidate of any kind (`probe_candidate`,
    locked or not): an outage with nothing left to probe holds nothing back (decision
    0026). Unlike a probe's close it owes no reconciliation (no probe showed the
    dependency working, DESIGN §6.7); one still owed by an earlier close stays owed.
    Returns the new (close) epoch, nothing when a candidate exists or the group moved on.

    The probe time test is written without `coalesce`: Citus refuses an `UPDATE`
    whose `coalesce` or `CASE` calls a function that is not immutable (`now()`).
    """
    due = or_(br.c.next_probe_at.is_(None), br.c.next_probe_at <= func.now())
    candidate = (
        select(d.c.message_id).where(d.c.group_id == bindparam("gid"), probe_candidate()).exists()
    )
    flipped = (
        update(br)
        .where(_open_at_epoch(), due, ~candidate)
        .values(**_closed())
        .returning(br.c.group_id, br.c.epoch)
        .cte("flipped")
    )
    return _recorded(flipped, t.CLOSED)


def probe_candidate() -> ColumnElement[bool]:
    """The row is a probe candidate of one of the `PROBE_KINDS` (probed in this outage
    or not): ready and due now, a systemic retry, or dead with the outage's charges
    and refunded fewer than `:max_refunds` times."""
    ready = and_(
        d.c.state == t.READY, or_(d.c.available_at <= func.now(), d.c.error_class == t.SYSTEMIC)
    )
    dead = and_(
        d.c.state == t.DEAD,
        carries_charges(),
        d.c.refunds < bindparam("max_refunds", type_=Integer),
    )
    return or_(ready, dead)


PROBE_KINDS = ("due", "retry", "dead")
"""The kinds of probe row, in the order they are tried (DESIGN §6.4): a ready row due
now, else the ready row whose systemic retry is due soonest (only those may be probed
ahead of their time, never a row the user scheduled), else a dead row the outage
charged (systemic, or reclaimed while a breaker was open) under the refund cap."""


def _probed_here() -> ColumnElement[bool]:
    """The row was a group probe in this outage (the OPEN epoch `:at_epoch`).

    Derived, not stored: a failure's `error_epoch` is the epoch its attempt was
    claimed under, and while the group is OPEN the claim statement gives no row
    out, so the only attempts that can fail under the OPEN epoch are its probes.
    (A lease that expires while the group is OPEN is charged under it too: that
    row merely waits behind the rows not yet probed.)
    Such a row's `updated_at` is when its probe's outcome was written (a ready or
    dead row is not touched again until it is claimed), so it orders the probed
    rows least recently probed first.
    """
    return d.c.error_epoch == bindparam("at_epoch", type_=Integer)


@cache
def claim_probe(kind: str, probed: bool, bodies: bool = True, ordered: bool = False) -> Executable:
    """Lease one probe row of `kind` (see `PROBE_KINDS`) to `:member` for `:lease`.

    `probed` False takes the rows not yet probed in the outage at `:at_epoch`
    (in the kind's natural order); True those already probed, least recently
    probed first. Tried in that order per kind, the probes rotate: one row whose
    handler fails for itself alone cannot be every probe. Dead rows qualify only
    while refunded fewer than `:max_refunds` times. `bodies`: see
    `pgq.sql.claim.lease_picked`. In an `ordered` group the probe keeps the order
    as a claim does (`pgq.sql.claim.key_free`).
    """
    ready = d.c.state == t.READY
    now = func.now()
    where: ColumnElement[bool]
    natural: tuple[Any, ...]
    if kind == "due":
        where, natural = and_(ready, d.c.available_at <= now), (d.c.available_at,)
    elif kind == "retry":
        # only a systemic retry may be probed ahead of its time: a row the user
        # scheduled (`delay=`, `RetryLater`) or a message failure's retry keeps it
        where = and_(ready, d.c.available_at > now, d.c.error_class == t.SYSTEMIC)
        natural = (d.c.available_at,)
    elif kind == "dead":
        where = and_(
            d.c.state == t.DEAD,
            carries_charges(),
            d.c.refunds < bindparam("max_refunds", type_=Integer),
        )
        natural = ()
    else:
        raise ValueError(f"unknown probe kind {kind!r}")
    if probed:
        where, order = and_(where, _probed_here()), (d.c.updated_at, d.c.message_id)
    else:
        where = and_(where, _probed_here().is_not(True))
        order = (*natural, d.c.message_id)
    pick = (
        select(d.c.message_id)
        .where(d.c.group_id == bindparam("gid"), where)
        .where(*([key_free(max_refunds=True)] if ordered else []))
        .order_by(*order)
        .limit(literal_column("1"))
        .with_for_update(skip_locked=True)
        .cte("pick")
    )
    return lease_picked(pick, bodies)


@cache
def reconcile_batch() -> Executable:
    """Refund up to `:limit` rows of `:gid` the outage charged, for the close `:close_epoch`.

    A row qualifies when it carries refundable charges made at or after epoch
    `:from_epoch` (the previous close) and before the close, whatever its last
    error class (a row that died of reclaims during the outage too), it is dead
    or ready (a retry due or not, a snooze), and it has been refunded fewer than
    `:max_refunds` times. Its refundable attempts and reclaims are subtracted and
    cleared, so no close refunds it twice. A dead row or a systemic retry becomes
    ready now; a row the user scheduled (a snooze) keeps its time. Each writes a
    line of the message's history: refunded by `:member` at the close `:close_epoch`.
    Returns how many rows were refunded (and adds them to the totals).
    """
    batch = (
        select(d.c.message_id, func.now().label("now"))
        .where(_owed_a_refund())
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
        .cte("batch")
    )
    refunded = (
        update(d)
        .where(d.c.group_id == bindparam("gid"), d.c.message_id == batch.c.message_id)
        .values(
            state=t.READY,
            # the time from the batch, not `now()` in the CASE: Citus refuses a
            # STABLE function in a CASE of a statement it cannot ship whole (0023)
            available_at=case(
                (or_(d.c.state == t.DEAD, d.c.error_class == t.SYSTEMIC), batch.c.now),
                else_=d.c.available_at,
            ),
            attempts=func.greatest(0, d.c.attempts - d.c.refundable_attempts),
            reclaims=func.greatest(0, d.c.reclaims - d.c.refundable_reclaims),
            refundable_attempts=0,
            refundable_reclaims=0,
            refunds=d.c.refunds + 1,
            error_class=None,
            events=d.c.events + 1,
            updated_at=func.now(),
        )
        .returning(d.c.message_id, d.c.events, d.c.attempts, d.c.reclaims, d.c.refunds)
        .cte("refunded")
    )
    r = refunded.c
    written = history.written_by(
        refunded,
        {
            "event": literal(AttemptEvent.REFUNDED.value),
            "member": bindparam("member", type_=Text),
            "seconds": null(),
            "error_class": null(),
            "error": null(),
            "epoch": bindparam("close_epoch", type_=Integer),
            "attempts": r.attempts,
            "reclaims": r.reclaims,
            "refunds": r.refunds,
        },
    )
    n = select(func.count()).select_from(refunded).scalar_subquery()
    counted = (
        update(gs)
        .where(gs.c.group_id == bindparam("gid"))
        .values(refunded_total=gs.c.refunded_total + n)
        .returning(gs.c.group_id)
        .cte("counted")
    )
    return (
        update(hist)
        .where(
            hist.c.group_id == bindparam("gid"),
            hist.c.epoch == bindparam("close_epoch", type_=Integer),
        )
        .values(refunded=hist.c.refunded + cast(n, BigInteger))
        .returning(n)
        .add_cte(counted, written)
    )


@cache
def reconcile_done() -> Executable:
    """Mark the reconciliation owed for `:close_epoch` finished, unless a row it owes a
    refund is left: a batch skips the rows another transaction holds (a killed
    prober's batch runs on the server until it finds its client gone and rolls
    back), so a batch that refunded nothing does not mean nothing is owed.
    Returns the close epoch when it marked it finished."""
    left = select(d.c.message_id).where(_owed_a_refund()).exists()
    return (
        update(br)
        .where(
            br.c.group_id == bindparam("gid"),
            br.c.reconcile_epoch == bindparam("close_epoch", type_=Integer),
            ~left,
        )
        .values(reconcile_epoch=None, reconcile_from_epoch=None)
        .returning(br.c.epoch)
    )


def _owed_a_refund() -> ColumnElement[bool]:
    """Rows of `:gid` the close `:close_epoch` owes a refund: charged at or after
    `:from_epoch` and before the close, dead or ready, refunded fewer than
    `:max_refunds` times."""
    return and_(
        d.c.group_id == bindparam("gid"),
        charged_within(
            bindparam("from_epoch", type_=Integer), bindparam("close_epoch", type_=Integer)
        ),
        d.c.refunds < bindparam("max_refunds", type_=Integer),
        d.c.state.in_([t.DEAD, t.READY]),
    )


def lock_held(key: int) -> Executable:
    """True while this session holds the session-level advisory lock `key`."""
    return select(advisory_held(literal(key, BigInteger), this_session=True))


def _probe_lease() -> ColumnElement[bool]:
    return and_(
        d.c.group_id == bindparam("gid"),
        d.c.message_id == bindparam("id", type_=BigInteger),
        d.c.lease_seq == bindparam("seq", type_=BigInteger),
        d.c.lease_owner == bindparam("member"),
    )


@cache
def probe_charges() -> Executable:
    """Whether the probe row on lease `:id`/`:seq` carries refundable charges (locked)."""
    return (
        select(d.c.refundable_attempts + d.c.refundable_reclaims > 0)
        .where(_probe_lease())
        .with_for_update()
    )


@cache
def probe_failed_dead() -> Executable:
    """The probe on lease `:id`/`:seq` of a row that was dead at its last attempt failed
    systemically (at the OPEN epoch `:at_epoch`, error `:error`): it stays dead and is
    charged no attempt (it has had its attempts; the probe asked about the dependency),
    so its attempts never pass `max_attempts` however long the outage. A row a close
    had refunded before failed again after a probe showed the dependency working: for
    it the failed revival counts toward the refund cap (`refunds` + 1), so one
    misclassified poison row cannot be every probe for good (decision 0026)."""
    return (
        update(d)
        .where(_probe_lease())
        .values(
            state=t.DEAD,
            error_class=t.SYSTEMIC,
            last_error=bindparam("error", type_=Text),
            error_epoch=bindparam("at_epoch", type_=Integer),
            refunds=d.c.refunds + case((d.c.refunds > 0, 1), else_=0),
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(d.c.message_id)
    )


@cache
def probe_done() -> Executable:
    """The probe on lease `:id`/`:seq` succeeded: done, its systemic charges refunded
    (the dependency works: those failures were not the message's), `refunds` +
    `:refunded` (1 when it had charges) and its error class cleared. A refund writes
    a line of the message's history (`refunded` by `:member` at `:close_epoch`, the
    counters after it), like the close's reconciliation of the other rows; a probe
    with nothing to refund is a success and writes none."""
    refunded = bindparam("refunded", type_=Integer)
    done = (
        update(d)
        .where(_probe_lease())
        .values(
            state=t.DONE,
            attempts=func.greatest(0, d.c.attempts - d.c.refundable_attempts) + 1,
            reclaims=func.greatest(0, d.c.reclaims - d.c.refundable_reclaims),
            refundable_attempts=0,
            refundable_reclaims=0,
            refunds=d.c.refunds + refunded,
            error_class=None,
            events=d.c.events + refunded,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(d.c.message_id, d.c.events, d.c.attempts, d.c.reclaims, d.c.refunds)
        .cte("done")
    )
    r = done.c
    refund = (
        select(r.message_id, r.events, r.attempts, r.reclaims, r.refunds)
        .where(refunded > 0)
        .cte("refund")
    )
    written = history.written_by(
        refund,
        {
            "event": literal(AttemptEvent.REFUNDED.value),
            "member": bindparam("member", type_=Text),
            "seconds": null(),
            "error_class": null(),
            "error": null(),
            "epoch": bindparam("close_epoch", type_=Integer),
            "attempts": refund.c.attempts,
            "reclaims": refund.c.reclaims,
            "refunds": refund.c.refunds,
        },
    )
    return select(r.message_id).add_cte(written)
