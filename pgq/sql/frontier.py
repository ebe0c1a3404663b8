"""Statements for the committed frontier, pruning and retention.

The frontier advances in (xid, id) commit order and only over transactions
older than the current snapshot's xmin, so it never passes a message whose
publishing transaction is still open. The advance is one statement, so the
xmin, the resolved/unresolved test and the new frontier all come from one
snapshot (`docs/decisions/0010-frontier-in-one-statement.md`); it reads only
the rows it passes (plus one), so its cost follows the change, not the table.

The frontier and the counters are in `group_state`: on Citus it is co-located
with `delivery`, so the advance and the prune each run as one task on the group's
node, against that node's snapshot and the xids its rows got there (decision 0023,
section 5).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Interval,
    any_,
    bindparam,
    cast,
    false,
    func,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql import ColumnElement, Executable
from sqlalchemy.sql.selectable import ScalarSelect

from pgq import schema as t

d, g, gs, m, pr = t.delivery, t.consumer_group, t.group_state, t.message, t.probe

MAX_ID = literal_column(str(2**63 - 1), BigInteger)


def _xmin() -> ColumnElement[Any]:
    return func.pg_snapshot_xmin(func.pg_current_snapshot())


def _position() -> Any:
    return tuple_(d.c.xid, d.c.message_id)


def _unresolved() -> ColumnElement[bool]:
    """Ready or leased, wrapped so that the planner does not estimate it.

    Its statistics say almost no row is ready or leased, so for "the first
    unresolved row in (xid, id) order" it read every row past the frontier and
    sorted them (a bitmap scan: 200 ms at 300k rows, every second, also behind
    one stuck message); with the estimate hidden it walks the frontier index in
    order and stops at the first one (one row when the stuck message is first).
    """
    return func.coalesce(d.c.state.in_([t.READY, t.LEASED]), false())


def space_of(state: Any = gs) -> ColumnElement[int]:
    """The xid space a group's frontier counts in where `state` (`group_state`, or an
    alias of it, in the statement's FROM) is read (decision 0047): the server's system
    identifier, xor the table's oid there. On Citus a routed statement evaluates it on
    the worker that holds the group's shard, and the shard is a new table on every
    node it is moved to, back to a node it left included."""
    oid = cast(literal_column(f"{state.name}.tableoid"), BigInteger)
    return literal_column(t.XID_SPACE, BigInteger).op("#")(oid)


SPACE = space_of()
"""`space_of` the group_state table itself (not aliased)."""

FROZEN = literal_column("'2'", t.XID8())
"""The xid a rebase gives rows that came from another xid space: below every
snapshot's xmin (PostgreSQL's own FrozenTransactionId), so committed to the frontier."""

ZERO = literal_column("0", BigInteger)
ONE = literal_column("1", Integer)
"""LIMIT 1 written into the statement (a bound limit can turn a prepared
statement's generic plan into a scan; see `pgq.sql.claim.claim`)."""


@cache
def without_jit() -> Executable:
    """Turn JIT compilation off for the rest of the transaction.

    `advance_frontier`'s bounds come from its own subqueries, so the planner
    estimates its ranges blind and its cost grows with the group's rows: from
    ~3.4M rows it passes `jit_above_cost`, and compiling added ~30 ms to an
    advance that takes ~2-4 ms, every second, on every member.
    """
    return select(func.set_config("jit", "off", True))


@cache
def advance_frontier() -> Executable:
    """Advance the frontier of `:gid` as far as it may go, in one statement; returns
    one row: `held` (false when another member holds the group row right now: it
    is advancing it) and `pruned`, the done rows passed and deleted.

    From the frontier `here` (the group's state row, locked, SKIP LOCKED), among rows of
    committed transactions (xid below the snapshot's xmin): `stop` is the first
    ready or leased row; `target` the last row before `stop` (before xmin when
    there is none). The frontier moves to `target`, and the done rows it passed
    are deleted and counted into `done_pruned`.

    One statement because every part must see one snapshot: with the test in one
    statement and the move in the next, a publish committing in between was
    below the second statement's xmin, unresolved, and passed (issue 9, defect
    7). The group row is read with the lock, i.e. in its latest committed
    version, which may be newer than the snapshot (another member's advance
    that just committed); starting from it is safe, because that member only
    passed rows resolved in its own snapshot, and this statement passes only
    rows resolved and committed in its own. Run after `without_jit`.
    """
    gid = bindparam("gid", type_=Integer)
    here = (
        select(gs.c.committed_xid.label("cx"), func.coalesce(gs.c.committed_id, ZERO).label("cid"))
        .where(gs.c.group_id == gid, gs.c.xid_space == SPACE)
        .with_for_update(skip_locked=True)
        .cte("here")
    )
    past = _position() > tuple_(
        select(here.c.cx).scalar_subquery(), select(here.c.cid).scalar_subquery()
    )
    committed = d.c.xid < _xmin()
    stop = (
        select(d.c.xid, d.c.message_id)
        .where(d.c.group_id == gid, past, committed, _unresolved())
        .order_by(d.c.xid, d.c.message_id)
        .limit(ONE)
        .cte("stop")
    )
    before_stop = _position() < tuple_(
        func.coalesce(select(stop.c.xid).scalar_subquery(), _xmin()),
        func.coalesce(select(stop.c.message_id).scalar_subquery(), ZERO),
    )
    target = (
        select(d.c.xid, d.c.message_id)
        .where(d.c.group_id == gid, past, committed, before_stop)
        .order_by(d.c.xid.desc(), d.c.message_id.desc())
        .limit(ONE)
        .cte("target")
    )
    nx, nid = select(target.c.xid).scalar_subquery(), select(target.c.message_id).scalar_subquery()
    pruned = _prune(past, _position() <= tuple_(nx, nid))
    moved = (
        update(gs)
        .where(gs.c.group_id == gid, select(target).exists())
        .values(committed_xid=nx, committed_id=nid, done_pruned=gs.c.done_pruned + pruned)
        .returning(gs.c.group_id)
        .cte("moved")
    )
    elsewhere = (
        select(gs.c.group_id)
        .where(gs.c.group_id == gid, gs.c.xid_space.is_distinct_from(SPACE))
        .exists()
    )
    return select(
        select(here).exists().label("held"), pruned.label("pruned"), elsewhere.label("moved")
    ).add_cte(moved)


@cache
def name_xid_space() -> Executable:
    """Name the xid space of group `:gid`'s frontier, not named yet, as this server's
    (at subscribe; and schema version 10: the groups that exist count in the xids of
    the server that holds them); returns how many it named. A SELECT on top like
    the advance, so that on Citus `SPACE` is the group's node's."""
    gid = bindparam("gid", type_=Integer)
    here = (
        select(gs.c.group_id, SPACE.label("space"))
        .where(gs.c.group_id == gid, gs.c.xid_space.is_(None))
        .with_for_update()
        .cte("here")
    )
    named = (
        update(gs)
        .where(gs.c.group_id == gid, select(here).exists())
        .values(xid_space=select(here.c.space).scalar_subquery())
        .returning(gs.c.group_id)
        .cte("named")
    )
    return select(func.count()).select_from(named)


@cache
def rebase_rows() -> Executable:
    """Step 1 of a rebase (decision 0047), when the frontier of `:gid` counts in
    another space than this server's: give `FROZEN` to the rows this statement sees
    at or above its snapshot's xmin, and in an ordered group to every keyed row it
    sees; returns how many. Step 2 is `rebase_frontier`, in the same transaction.

    A group's rows keep the xids they were written with when Citus moves its shard
    to another node (or a dump is restored on another server), and that node counts
    its own: rows written there after the move can fall behind the old frontier
    while still ready, and moved rows can look uncommitted there (xid above its
    xmin) for as long as its counter takes to catch up. Every row this statement
    sees is committed (rows of transactions still open are invisible to it and keep
    their own, local, xid, at or above its xmin), so the ones at or above the xmin
    may be frozen. A key's rows keep their order only if all of them are (by id,
    among the rows that were there) and come before every row written later: xids of
    two servers do not compare (`claim.key_free` leases no keyed row meanwhile).

    The rows are locked before the group's row (step 2), as an ack locks them: the
    other order deadlocked with an ack waiting for the group's row. A SELECT on top,
    like the advance, so that Citus ships it whole to the group's node and the space
    and the xmin are that node's.
    """
    gid = bindparam("gid", type_=Integer)
    elsewhere = (
        select(_xmin().label("xmin"))
        .where(gs.c.group_id == gid, gs.c.xid_space.is_distinct_from(SPACE))
        .cte("elsewhere")
    )
    at_or_above_xmin = d.c.xid >= select(elsewhere.c.xmin).scalar_subquery()
    frozen = (
        update(d)
        .where(d.c.group_id == gid, select(elsewhere).exists())
        .where(or_(at_or_above_xmin, d.c.key.is_not(None)))
        .values(xid=FROZEN)
        .returning(d.c.message_id)
        .cte("frozen")
    )
    return select(func.count()).select_from(frozen)


@cache
def rebase_frontier() -> Executable:
    """Step 2 of a rebase (after `rebase_rows`): the frontier of `:gid` goes back to
    the start, xid 0, below every row (every row is past it: the next advance walks
    the group's rows again and passes only resolved ones), keeping its id for
    `committed` to show while no row is left to land on (a drained group's frontier
    pruned them all), and names this server's space. Returns one row: `rebased`
    (false when another member rebased it first) and `was`, the space it counted in.
    """
    gid = bindparam("gid", type_=Integer)
    here = (
        select(gs.c.group_id, gs.c.xid_space.label("was"), SPACE.label("space"))
        .where(gs.c.group_id == gid, gs.c.xid_space.is_distinct_from(SPACE))
        .with_for_update()
        .cte("here")
    )
    reset = (
        update(gs)
        .where(gs.c.group_id == gid, select(here).exists())
        .values(
            committed_xid=literal_column("'0'", t.XID8()),
            committed_id=gs.c.committed_id,
            xid_space=select(here.c.space).scalar_subquery(),
        )
        .returning(gs.c.group_id)
        .cte("reset")
    )
    was = select(here.c.was).scalar_subquery()
    return select(select(reset).exists().label("rebased"), was.label("was"))


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
def prune_behind() -> Executable:
    """Prune done rows anywhere behind the frontier of `:gid` (rows a requeue or a
    refund sent back behind it and that finished since); returns the count."""
    upto = tuple_(d.c.xid, d.c.message_id) <= tuple_(gs.c.committed_xid, gs.c.committed_id)
    count = _prune(gs.c.group_id == d.c.group_id, gs.c.committed_id.is_not(None), upto)
    return (
        update(gs)
        .where(gs.c.group_id == bindparam("gid"))
        .values(done_pruned=gs.c.done_pruned + count)
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

    A group's row goes only when it is finished: its ack deletes it, or (the one
    row an ack keeps per batch) the frontier's pruning once it is behind; both
    count it in `done_pruned`. So a message without rows is one every group
    finished, or one that a group subscribed later with `start="latest"` never
    had. Any other row (ready, leased, dead, or done ahead of its frontier) keeps
    its message. Runs after
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
    cutoff = _cutoff()
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


def _cutoff() -> ColumnElement[Any]:
    return func.now() - bindparam("retention", type_=Interval)


@cache
def expired_candidates() -> Executable:
    """Retention on Citus, step 1 of 3 (one task, the topic's shard of `message`):
    up to `:limit` messages of `:topic_id` after id `:after`, older than
    `:retention` and below the topic's first young message (as
    `delete_expired_messages`), in id order, locked FOR UPDATE SKIP LOCKED so that
    members expiring at once take different ones.

    Runs after the topic's advisory lock, shared (`pgq.sql.locks.topic_key`), in
    a statement of its own; page after page (`:after`, the last id of the page
    before) until `:limit` of them are held by no group, as the one statement
    skips held messages while it fills its batch (a group's dead rows at the head
    of the topic must not stop retention). The steps run in one transaction: a
    group can only lose delivery rows meanwhile (its frontier prunes them; a
    subscribe that would add some waits for the topic lock), so a message found
    unheld in step 2 stays unheld until step 3 deletes it.

    On one server retention stays `delete_expired_messages`, one statement.
    Measured there (`pgq.sql.frontier` statements, 50k expired messages, two
    groups, one holding every tenth; 40 batches of 5,000 each way, interleaved,
    rolled back; 2 shared cores, load ~4.6; medians of two runs): a batch took
    73 / 78 ms as one statement (5,000 deleted) and 91 / 102 ms as these steps
    (one page: 4,500 deleted, the held ones took places in it), ~30 % more per
    message deleted; with nothing expired 1.1 / 1.7 ms against 0.8 / 1.6 ms.
    """
    young = m.alias("young")
    first_young = (
        select(young.c.id)
        .where(young.c.topic_id == bindparam("topic_id"), young.c.created_at >= _cutoff())
        .order_by(young.c.id)
        .limit(ONE)
        .scalar_subquery()
    )
    return (
        select(m.c.id)
        .where(m.c.topic_id == bindparam("topic_id"), m.c.created_at < _cutoff())
        .where(m.c.id > bindparam("after", type_=BigInteger))
        .where(m.c.id < func.coalesce(first_young, MAX_ID))
        .order_by(m.c.id)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
    )


@cache
def groups_of_topic() -> Executable:
    """The ids of topic `:topic_id`'s groups."""
    return select(g.c.id).where(g.c.topic_id == bindparam("topic_id")).order_by(g.c.id)


@cache
def held_by_group() -> Executable:
    """Retention on Citus, step 2 (one task per group, on its shard): which of the
    messages `:ids` group `:gid` still has a delivery row for."""
    return select(d.c.message_id).where(
        d.c.group_id == bindparam("gid", type_=Integer),
        d.c.message_id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
    )


@cache
def delete_messages() -> Executable:
    """Retention on Citus, step 3 (one task): delete messages `:ids` of topic
    `:topic_id`; returns their ids."""
    return (
        m.delete()
        .where(
            m.c.topic_id == bindparam("topic_id"),
            m.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
        )
        .returning(m.c.id)
    )


@cache
def delete_expired_probes() -> Executable:
    """Delete up to `:limit` of group `:gid`'s logged probes older than `:retention`,
    oldest first; returns how many.

    One statement: the victims come from `probe_at_idx` (the group's probes by time,
    so it reads only what it deletes, plus one). Probes come at most one per probe
    interval, so a batch per retention pass keeps up. No `FOR UPDATE`: locking a
    row needs UPDATE on the table, and a consumer never updates a probe; of two
    members that prune at once the second waits for the first's delete and finds
    those rows gone.
    """
    cutoff = func.now() - bindparam("retention", type_=Interval)
    victims = (
        select(pr.c.id)
        .where(pr.c.group_id == bindparam("gid", type_=Integer), pr.c.at < cutoff)
        .order_by(pr.c.at)
        .limit(bindparam("limit", type_=Integer))
        .cte("victims")
    )
    deleted = (
        pr.delete()
        .where(pr.c.group_id == bindparam("gid", type_=Integer), pr.c.id == victims.c.id)
        .returning(pr.c.id)
        .cte("deleted")
    )
    return select(func.count()).select_from(deleted)
