"""Statements for group membership: join, heartbeat, leave, forgetting departed members,
and the drain check."""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Boolean,
    Integer,
    Interval,
    Text,
    and_,
    bindparam,
    cast,
    delete,
    func,
    literal,
    literal_column,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, OID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql import ColumnElement, Executable

from pgq import schema as t
from pgq.sql.locks import advisory_held, held_advisory_keys

mb, d, br = t.member, t.delivery, t.breaker


def _key(
    table_oid: ColumnElement[Any], gid: ColumnElement[Any], name: ColumnElement[Any], purpose: str
) -> ColumnElement[int]:
    """hashtextextended of `oid:[purpose:]gid:name`: a member's lock key for `purpose`."""
    text = cast(table_oid, Text) + literal(":" + (f"{purpose}:" if purpose else ""))
    return func.hashtextextended(text + cast(gid, Text) + literal(":") + name, 0)


def member_key(
    gid: ColumnElement[Any], name: ColumnElement[Any], purpose: str
) -> ColumnElement[int]:
    """The advisory lock key of member `name` of group `gid` for `purpose` ("" the
    member's session lock, "prober" the elected prober's name lock): a hash of the
    member table's oid (`:table`, the schema-qualified name: one per schema and
    database), the group and the name, so no key is stored."""
    table_oid = cast(func.to_regclass(bindparam("table", type_=Text)), OID)
    return _key(table_oid, gid, name, purpose)


def session_key_for() -> ColumnElement[int]:
    """The session lock key of member `:member` in group `:gid`."""
    return member_key(bindparam("gid", type_=Integer), bindparam("member", type_=Text), "")


HOLDERS = {"": "present", "prober": "prober"}
"""The parameter prefix (`:present_gids`/`:present_names`) under which a statement
takes the members holding each kind of lock (`holding`)."""


@cache
def member_names(every_group: bool, scope: str) -> Executable:
    """(group_id, name) of the member rows of `:gid` (of every group) whose locks a
    statement may need to know: `fresh` ones (not left, heard from within `:ttl`:
    only they can be live), `departed` ones (departed longer than `:after` ago:
    what `forget_departed` may delete), or `all`."""
    stmt = select(mb.c.group_id, mb.c.name)
    if scope == "fresh":
        stmt = stmt.where(_fresh())
    elif scope == "departed":
        stmt = stmt.where(departed_at() < func.now() - bindparam("after", type_=Interval))
    elif scope != "all":
        raise ValueError(f"unknown scope {scope!r}")
    return stmt if every_group else stmt.where(mb.c.group_id == bindparam("gid"))


@cache
def holding(purpose: str) -> Executable:
    """Of the members `:gids`/`:names` (pairs), those whose `purpose` lock some session
    of this database holds (`pg_locks`): (group_id, name) rows.

    A statement of its own, over no table of pgq's: members take their locks on the
    session they connect (on Citus, the coordinator), and a test of `pg_locks` inside
    a statement over `member` would run where the group's shard is (0023, 3.1). The
    statements that need liveness take the answer as parameters (`holds`).

    `pg_locks` is read once, its advisory keys hashed (`IS TRUE` keeps the `IN` a
    hashed subplan): a test per name read the whole lock table once per name, 0.3 s
    for 22,000 departed member rows (docs/defects.md)."""
    pairs = _pairs("gids", "names")
    key = member_key(pairs.c.group_id, pairs.c.name, purpose)
    return select(pairs.c.group_id, pairs.c.name).where(key.in_(held_advisory_keys()).is_(true()))


def _pairs(gids: str, names: str) -> Any:
    return (
        func.unnest(bindparam(gids, type_=ARRAY(Integer)), bindparam(names, type_=ARRAY(Text)))
        .table_valued("group_id", "name")
        .render_derived()
    )


def holds(purpose: str = "") -> ColumnElement[bool]:
    """The member row at hand holds its `purpose` lock: it is one of the pairs
    `holding(purpose)` found, passed as `:<prefix>_gids`/`:<prefix>_names`
    (`HOLDERS`). `IS TRUE` keeps the pairs a hashed subplan (see `claim.pairwise`)."""
    prefix = HOLDERS[purpose]
    pairs = _pairs(f"{prefix}_gids", f"{prefix}_names")
    found = select(pairs.c.group_id, pairs.c.name)
    return tuple_(mb.c.group_id, mb.c.name).in_(found).is_(true())


def session_present() -> ColumnElement[bool]:
    """Some session of this database holds the member row's session lock: the
    member's process is still connected (`kill -9` ends it at once)."""
    return holds("")


def member_live(ttl: ColumnElement[Any] | None = None) -> ColumnElement[bool]:
    """A member row is live (DESIGN §6.2): not left, heard from within `ttl` (default
    the `:ttl` interval parameter), and its session is still there (`holds`)."""
    if ttl is None:
        ttl = bindparam("ttl", type_=Interval)
    return and_(_fresh(ttl), session_present())


def _fresh(ttl: ColumnElement[Any] | None = None) -> ColumnElement[bool]:
    """Not left, and heard from within `ttl` (default the `:ttl` interval parameter)."""
    if ttl is None:
        ttl = bindparam("ttl", type_=Interval)
    return and_(mb.c.left_at.is_(None), mb.c.last_seen > func.now() - ttl)


def _live() -> ColumnElement[bool]:
    return member_live()


@cache
def take_session_lock() -> Executable:
    """Try `:member`'s session lock in `:gid` (member table `:table`); true when held."""
    return select(func.pg_try_advisory_lock(session_key_for()))


@cache
def release_session_lock() -> Executable:
    """Release `:member`'s session lock in `:gid` held by this session."""
    return select(func.pg_advisory_unlock(session_key_for()))


@cache
def session_lock_held() -> Executable:
    """True while this very session holds `:member`'s session lock in `:gid`."""
    return select(advisory_held(session_key_for(), this_session=True))


def _this_process() -> ColumnElement[bool]:
    """The row of `:member` in `:gid` as this process joined it (`:started`, the
    `started_at` its join returned): a process whose name was taken over by a
    restart while it was paused finds nothing to update."""
    return and_(
        mb.c.group_id == bindparam("gid"),
        mb.c.name == bindparam("member"),
        mb.c.started_at == bindparam("started"),
    )


@cache
def join_new() -> Executable:
    """Register `:member` in `:gid` when the name has no row; returns its `started_at`
    (the process's token for its heartbeats), nothing when the row exists.

    The first of the two statements of a join (`join_existing` is the second): a
    starter that finds the name taken neither waits for nor changes that row here.
    Two starters inserting the same new name at once: the second waits for the
    first's transaction and then finds the row. No `ON CONFLICT DO UPDATE`: Citus
    refuses `now()` in its `SET` or `WHERE` (0023, section 6).
    """
    return (
        pg_insert(mb)
        .values(
            group_id=bindparam("gid"),
            name=bindparam("member"),
            host=bindparam("host"),
            pid=bindparam("pid"),
        )
        .on_conflict_do_nothing(index_elements=[mb.c.group_id, mb.c.name])
        .returning(mb.c.started_at)
    )


@cache
def join_existing() -> Executable:
    """Take over the existing row of `:member` in `:gid` for this process (`:host`,
    `:pid`); returns its new `started_at`, nothing when refused or when the row is
    gone (then `join_new` again).

    With `:takeover` (the caller holds the member's session lock, so no other
    process runs under this name) it always takes it; without it (a stale session
    still holds the lock: a paused process) only when the row has not been heard
    from within `:ttl`. Of two starters taking a silent row over at once, the row
    lock lets one through; the other rechecks the row it then sees, now fresh, and
    is refused.
    """
    return (
        update(mb)
        .where(
            mb.c.group_id == bindparam("gid"),
            mb.c.name == bindparam("member"),
            or_(bindparam("takeover", type_=Boolean), ~_fresh()),
        )
        .values(
            host=bindparam("host"),
            pid=bindparam("pid"),
            started_at=func.now(),
            last_seen=func.now(),
            left_at=None,
            local_breaker=literal_column("'closed'"),
            tripped_epoch=None,
        )
        .returning(mb.c.started_at)
    )


@cache
def heartbeat() -> Executable:
    """Record that `:member` is alive, with its local breaker `:local` (tripped under
    `:tripped_epoch`); returns the group breaker's state and epoch, nothing when
    another process has taken the name over.

    The breaker is read by `:gid`, not correlated on the member row's group: on
    Citus the correlation makes this a statement over every shard (0023, 3.2)."""
    return (
        update(mb)
        .where(_this_process())
        .values(
            last_seen=func.now(),
            left_at=None,
            local_breaker=bindparam("local"),
            tripped_epoch=bindparam("tripped_epoch", type_=Integer),
        )
        .returning(
            select(br.c.state)
            .where(br.c.group_id == bindparam("gid"))
            .scalar_subquery()
            .label("state"),
            select(br.c.epoch)
            .where(br.c.group_id == bindparam("gid"))
            .scalar_subquery()
            .label("epoch"),
        )
    )


@cache
def leave() -> Executable:
    """Mark `:member` as gone from `:gid` (unless another process took the name over)."""
    return (
        update(mb)
        .where(_this_process())
        .values(left_at=func.now(), local_breaker=literal_column("'closed'"))
    )


def departed_at() -> ColumnElement[Any]:
    """When a member row's member departed: when it left, else its last heartbeat (a
    member that died or lost its session; for a live member, its last heartbeat)."""
    return func.coalesce(mb.c.left_at, mb.c.last_seen)


@cache
def forget_departed() -> Executable:
    """Delete the members of `:gid` that departed longer than `:after` (an interval)
    ago; returns their names.

    Never a member whose session still holds its lock (a live member, or a paused
    process that may resume), nor one whose name still holds a leased row (a lease
    is fenced by its owner's name until it is reclaimed). The departed rows are
    few (a cron run leaves one), so one statement deletes them all. A join under
    the same name at the same moment either updates the row first (then it has
    not departed when the delete re-checks it) or waits and inserts it afresh.
    """
    holds_lease = (
        select(literal(1))
        .where(
            d.c.group_id == bindparam("gid"), d.c.state == t.LEASED, d.c.lease_owner == mb.c.name
        )
        .exists()
    )
    return (
        delete(mb)
        .where(
            mb.c.group_id == bindparam("gid"),
            departed_at() < func.now() - bindparam("after", type_=Interval),
            ~session_present(),
            ~holds_lease,
        )
        .returning(mb.c.name)
    )


@cache
def drain_state() -> Executable:
    """What stands between `:member` and an empty group `:gid`.

    Returns (ready now, waiting for a later retry, of those the ones due within
    `:wait`, leased by this member or by members that are not live — rows whose
    leases must expire and be reclaimed; a row leased before its owner's name was
    taken over counts as its silent holder's — and whether a close still owes a
    reconciliation: the group is not empty until its refunds are made).
    """
    holder_live = (  # a row leased before the name's holder started is a silent
        select(mb.c.name)  # process's: one killed, whose name a restart took over
        .where(
            mb.c.group_id == bindparam("gid"),
            mb.c.name == d.c.lease_owner,
            mb.c.started_at <= d.c.updated_at,
            _live(),
        )
        .exists()
    )
    ready = d.c.state == t.READY
    return select(
        func.count().filter(and_(ready, d.c.available_at <= func.now())).label("ready_now"),
        func.count().filter(and_(ready, d.c.available_at > func.now())).label("waiting_retry"),
        func.count()
        .filter(
            and_(
                ready,
                d.c.available_at > func.now(),
                d.c.available_at <= func.now() + bindparam("wait", type_=Interval),
            )
        )
        .label("due_soon"),
        func.count()
        .filter(
            and_(d.c.state == t.LEASED, (d.c.lease_owner == bindparam("member")) | ~holder_live)
        )
        .label("held"),
        select(br.c.reconcile_epoch.is_not(None))
        .where(br.c.group_id == bindparam("gid"))
        .scalar_subquery()
        .label("reconciling"),
    ).where(d.c.group_id == bindparam("gid"), d.c.state.in_([t.READY, t.LEASED]))
