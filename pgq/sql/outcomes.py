"""Statements that record attempt outcomes, fenced on the lease.

An outcome applies only where the row is still leased to this member under
the same `lease_seq` it was claimed with (every state change away from
`leased` clears `lease_owner`, so owner + seq is the whole fence, and the
statements need no `state` test that would tempt the planner into the
partial lease-sweep index); a member that lost its lease (paused past it,
reclaimed by someone else) writes nothing. Both statements return the ids
they applied to, so the caller knows which outcomes were refused.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    Text,
    any_,
    bindparam,
    case,
    func,
    literal_column,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import ColumnElement, Executable

from pgq import schema as t
from pgq.records import AttemptEvent
from pgq.sql import history
from pgq.sql.claim import fenced, held_by

d = t.delivery


@cache
def ack_done() -> Executable:
    """Finish the leases `:ids`/`:seqs` of `:gid` held by `:member`; returns the
    (message_id, lease_seq) of those applied.

    The rows go at once (decision 0037): a delete maintains no index, where
    marking them done wrote a new version into three and left the frontier a
    delete to do later. One row per batch stays, marked done with its attempt
    charged: the batch's last in (xid, id) order, for the frontier to land on
    (it passes only rows that exist; the globally last row of a drained group is
    always such a row, so at rest `committed` is the last message, as before).
    The frontier prunes it as it did every done row. The deleted rows are counted
    into the group's `done_pruned` in the same statement: its row lock is held from
    here to the commit, a millisecond per batch, which members' ackers take in turn
    (the frontier's advance skips the row while one holds it, and tries again). An
    ack that deleted nothing (a batch of one, as at a low rate) leaves the group's
    row alone: no new version of it, no lock for the next member's ack to wait on.
    """
    position = tuple_(d.c.xid, d.c.message_id)
    last = (
        select(d.c.xid, d.c.message_id)
        .where(fenced())
        .order_by(d.c.xid.desc(), d.c.message_id.desc())
        .limit(literal_column("1"))
        .cte("last")
    )
    is_last = position.in_(select(last.c.xid, last.c.message_id))
    marked = (
        update(d)
        .where(fenced(), is_last)
        .values(
            state=t.DONE,
            attempts=d.c.attempts + 1,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(d.c.message_id, d.c.lease_seq)
        .cte("marked")
    )
    gone = d.delete().where(fenced(), ~is_last).returning(d.c.message_id, d.c.lease_seq).cte("gone")
    gs = t.group_state
    deleted = select(func.count()).select_from(gone).scalar_subquery()
    counted = (
        update(gs)
        .where(gs.c.group_id == bindparam("gid"), deleted > 0)
        .values(done_pruned=gs.c.done_pruned + deleted)
        .returning(gs.c.group_id)
        .cte("counted")
    )
    return (
        select(marked.c.message_id, marked.c.lease_seq)
        .union_all(select(gone.c.message_id, gone.c.lease_seq))
        .add_cte(counted)
    )


@cache
def record_failures() -> Executable:
    """Apply failures and snoozes to the leases named by parallel arrays.

    Per row: `states` (ready or dead), `charges` (1 for a finished attempt, 0
    for a snooze), `delays` (seconds until claimable again), `classes`
    (error_class, NULL for a snooze), `errors` (text), `epochs` (the breaker
    epoch the attempt ran under), `seconds` (how long its handler ran, or NULL).
    Each writes a line of the message's history (`pgq.sql.history`). A systemic
    failure adds one refundable attempt; any other failure resets the refundable
    charges. A snooze keeps the charges but clears the error class: the row now
    waits for the time the user asked for, not for a systemic retry, so no probe
    or refund runs it before then.

    The times (`now()` + delay) are computed in the input, from `:delays` alone,
    and the `SET` only copies them: Citus refuses a STABLE function called with
    a column reference in an `UPDATE` (0023, section 6).
    """
    o = (
        func.unnest(
            bindparam("ids", type_=ARRAY(BigInteger)),
            bindparam("seqs", type_=ARRAY(BigInteger)),
            bindparam("states", type_=ARRAY(Text)),
            bindparam("charges", type_=ARRAY(Integer)),
            _available_at(),
            bindparam("classes", type_=ARRAY(Text)),
            bindparam("errors", type_=ARRAY(Text)),
            bindparam("epochs", type_=ARRAY(Integer)),
            bindparam("seconds", type_=ARRAY(Float)),
        )
        .table_valued(
            "message_id", "seq", "state", "charge", "due", "class", "error", "epoch", "seconds"
        )
        .render_derived()
    )
    snooze = o.c["class"].is_(None)
    systemic = o.c["class"] == t.SYSTEMIC
    failed = (
        update(d)
        .where(
            held_by(d.c.lease_owner == bindparam("member")),
            d.c.message_id == o.c.message_id,
            d.c.lease_seq == o.c.seq,  # the join on the input pairs is the fence
        )
        .values(
            state=o.c.state,
            attempts=d.c.attempts + o.c.charge,
            available_at=o.c.due,
            error_class=o.c["class"],
            last_error=case((snooze, d.c.last_error), else_=o.c.error),
            error_epoch=case((snooze, d.c.error_epoch), else_=o.c.epoch),
            refundable_attempts=case(
                (snooze, d.c.refundable_attempts),
                (systemic, d.c.refundable_attempts + 1),
                else_=literal_column("0"),
            ),
            refundable_reclaims=case(
                (snooze, d.c.refundable_reclaims),
                (systemic, d.c.refundable_reclaims),
                else_=literal_column("0"),
            ),
            events=d.c.events + 1,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(
            d.c.message_id,
            d.c.lease_seq,
            d.c.events,
            d.c.state,
            d.c.attempts,
            d.c.reclaims,
            d.c.refunds,
            o.c["class"],
            o.c.error,
            o.c.epoch,
            o.c.seconds,
        )
        .cte("failed")
    )
    f = failed.c
    written = history.written_by(
        failed,
        {
            "event": case(
                (f["class"].is_(None), AttemptEvent.SNOOZED.value),
                (f.state == t.DEAD, AttemptEvent.DIED.value),
                else_=AttemptEvent.FAILED.value,
            ),
            "member": bindparam("member", type_=Text),
            "seconds": f.seconds,
            "error_class": f["class"],
            "error": f.error,
            "epoch": f.epoch,
            "attempts": f.attempts,
            "reclaims": f.reclaims,
            "refunds": f.refunds,
        },
    )
    return select(f.message_id, f.lease_seq).add_cte(written)


def _available_at() -> ColumnElement[Any]:
    """`now()` + each of `:delays` (seconds), as an array in the same order."""
    delays = (
        func.unnest(bindparam("delays", type_=ARRAY(Float)))
        .table_valued("delay", with_ordinality="n")
        .render_derived()
    )
    due = select(func.now() + delays.c.delay * text("interval '1 second'")).order_by(delays.c.n)
    return func.array(due.scalar_subquery())


@cache
def settled() -> Executable:
    """The rows of `:gid` for the messages `:ids`, whoever holds them: lease token,
    state, attempts, whether a lease is held and error class. From them the caller
    tells its own outcome, written by a statement whose answer was lost, from a
    reclaim: a row no longer leased that still carries the outcome's token (a
    claim's token is never given again: only the holder's outcome or an expiry
    sweep could have ended it), or for a success no row at all (the ack deletes
    what it finishes)."""
    return select(
        d.c.message_id,
        d.c.lease_seq,
        d.c.state,
        d.c.attempts,
        d.c.lease_owner.is_(None),
        d.c.error_class,
    ).where(
        d.c.group_id == bindparam("gid"),
        d.c.message_id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
    )
