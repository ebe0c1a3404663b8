"""Statements behind the admin commands: `pgq check`, `show` and `audit` read,
`pgq requeue` and `purge` write.

`pgq check` reads the group's breaker row and its dead rows split by what they
mean for alerting (see `pgq.monitor.check`); `pgq requeue` turns dead rows back
to ready and `pgq purge` deletes them, each writing its audit row in the same
statement (one statement: the change and its audit row cannot come apart);
`pgq show` reads one message with its row, `pgq audit` the audit trail.

Dead rows always carry an error class (every path to `dead` sets one), so the
dead-row statements also say `error_class IS NOT NULL`: that lets them use the
partial index on failed rows instead of reading every row of the group. The
group is `:gid` everywhere (a parameter named like a column, `group_id`, would
also be SET by the UPDATE).
"""

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
    insert,
    literal,
    literal_column,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, aggregate_order_by
from sqlalchemy.schema import DropSchema
from sqlalchemy.sql import ColumnElement, Executable, Insert, Select

from pgq import schema as t
from pgq.records import BreakerState, ErrorClass, Start
from pgq.sql.frontier import SPACE
from pgq.sql.messages import delivery_matches, message_matches
from pgq.sql.refunds import charged_within

d, br, g, gs, audit = t.delivery, t.breaker, t.consumer_group, t.group_state, t.audit

REQUEUE_ACTION = "requeue"
"""The `audit.action` of a requeue."""

PURGE_ACTION = "purge"
"""The `audit.action` of a purge."""


# --- pgq check ------------------------------------------------------------------


def _count_in_state(state: ColumnElement[Any]) -> Any:
    return (
        select(func.count())
        .where(d.c.group_id == bindparam("gid", type_=Integer), d.c.state == state)
        .scalar_subquery()
    )


@cache
def check_group() -> Select[Any]:
    """Group `:gid`'s breaker row (state, epoch, reconciliation owed), frontier and lag.

    `ready` and `leased` are counted separately, each through its partial index.
    """
    return (
        select(
            func.coalesce(br.c.state, BreakerState.CLOSED.value).label("state"),
            func.coalesce(br.c.epoch, 0).label("epoch"),
            br.c.reconcile_epoch,
            br.c.reconcile_from_epoch,
            gs.c.committed_id,
            _count_in_state(t.READY).label("ready"),
            _count_in_state(t.LEASED).label("leased"),
        )
        .select_from(
            g.outerjoin(gs, gs.c.group_id == g.c.id).outerjoin(br, br.c.group_id == g.c.id)
        )
        .where(g.c.id == bindparam("gid", type_=Integer))
    )


def _max_refunds() -> ColumnElement[int]:
    return bindparam("max_refunds", type_=Integer)


def _pending() -> ColumnElement[bool]:
    """The dead row will come back with the owed or coming reconciliation: charged
    by the outage within the epochs `[:pending_from, :pending_to)` and refunded
    fewer than `:max_refunds` times (NULL bounds: no row is pending)."""
    within = charged_within(
        bindparam("pending_from", type_=Integer), bindparam("pending_to", type_=Integer)
    )
    return func.coalesce(and_(d.c.refunds < _max_refunds(), within), False)


@cache
def check_dead() -> Executable:
    """Dead rows of group `:gid` by what they mean for alerting.

    `dead` every dead row; `pending` the rows the owed or coming reconciliation
    will bring back: charged by the outage within the epochs
    `[:pending_from, :pending_to)` and refunded fewer than `:max_refunds` times
    (NULL bounds: none are pending); `capped` systemic rows that reached the
    refund cap (they stay dead); the rest by error class: `message`,
    `permanent`, `lease`, `systemic` (each count leaves out the pending and
    capped rows, so the parts add up to `dead`); `pending_ready` the ready rows
    the same reconciliation owes a refund (not dead letters at all).
    """
    pending = _pending()
    capped = and_(d.c.error_class == t.SYSTEMIC, d.c.refunds >= _max_refunds())
    real = and_(~pending, ~capped)
    return select(
        func.count().label("dead"),
        func.count().filter(d.c.error_class == ErrorClass.MESSAGE.value).label("message"),
        func.count().filter(d.c.error_class == ErrorClass.PERMANENT.value).label("permanent"),
        func.count().filter(and_(d.c.error_class == ErrorClass.LEASE.value, real)).label("lease"),
        func.count().filter(and_(d.c.error_class == t.SYSTEMIC, real)).label("systemic"),
        func.count().filter(capped).label("capped"),
        func.count().filter(pending).label("pending"),
        select(func.count())
        .where(d.c.group_id == bindparam("gid", type_=Integer), d.c.state == t.READY, _pending())
        .scalar_subquery()
        .label("pending_ready"),
    ).where(
        d.c.group_id == bindparam("gid", type_=Integer),
        d.c.state == t.DEAD,
        d.c.error_class.is_not(None),
    )


# --- pgq requeue ----------------------------------------------------------------


@cache
def lock_dead_ids() -> Select[Any]:
    """Which of `:ids` are dead rows of `:gid`, locked until the transaction ends."""
    return select(d.c.message_id).where(*_dead_rows(only_ids=True)).with_for_update()


@cache
def lock_key_successors() -> Select[Any]:
    """Lock the ready keyed rows of `:gid` whose key has a dead row, waiting for any
    claim in flight on them (an ordered group's requeue, decision 0044).

    A requeue makes an earlier dead row of a key ready again. A claim that has leased
    a later row of that key but not committed yet shows that row as ready to
    everyone else, so a claim that saw the requeue committed took the earlier row
    beside it: two messages of one key at once. Taking these locks first, the
    requeue commits only after such a claim has, and every claim that sees the
    requeued row sees the later one leased."""
    later, dead = d.alias("later"), d.alias("dead_of_key")
    has_dead = (
        select(literal(1))
        .where(
            dead.c.group_id == bindparam("gid", type_=Integer),
            dead.c.key == later.c.key,
            dead.c.state == t.DEAD,
        )
        .exists()
    )
    return (
        select(later.c.message_id)
        .where(
            later.c.group_id == bindparam("gid", type_=Integer),
            later.c.key.is_not(None),
            later.c.state == t.READY,
            has_dead,
        )
        .with_for_update(of=later)
    )


def _dead_rows(
    only_ids: bool = False, of_class: bool = False, matching: frozenset[str] = frozenset()
) -> list[ColumnElement[bool]]:
    """Dead rows of `:gid` (only `:ids`; only those of error class `:cls`; only those
    that match a `MessageFilter` of shape `matching`, its values as
    `pgq.sql.messages` names them: the message's side as an `EXISTS`)."""
    where = [
        d.c.group_id == bindparam("gid", type_=Integer),
        d.c.state == t.DEAD,
        d.c.error_class.is_not(None),
    ]
    if only_ids:
        where.append(d.c.message_id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
    if of_class:
        where.append(d.c.error_class == bindparam("cls", type_=Text))
    if matching:
        where += delivery_matches(matching)[1:]  # the group is said above
        on_message = message_matches(matching)
        if on_message:
            m = t.message
            where.append(select(m.c.id).where(m.c.id == d.c.message_id, *on_message).exists())
    return where


def listed_ids(changed: Any, column: str = "message_id") -> Any:
    """The smallest `:max_listed` of the ids in `column` of CTE `changed`, as one
    JSON array (`[]` when it is empty): what an audit row lists."""
    listed = (
        select(changed.c[column].label("id"))
        .order_by(changed.c[column])
        .limit(bindparam("max_listed", type_=Integer))
        .subquery("listed")
    )
    return select(
        func.coalesce(
            func.jsonb_agg(aggregate_order_by(listed.c.id, listed.c.id)),
            cast(literal("[]"), JSONB),
        )
    ).scalar_subquery()


AUDIT_COLUMNS = (
    "group_id",
    "action",
    "message_ids",
    "count",
    "reason",
    "actor",
    "role",
    "group_name",
    "topic",
)
"""What pgq writes in an audit row (`id` and `at` are the database's)."""


def _audit_values(action: str, ids: Any, count: Any) -> list[Any]:
    """The values of `AUDIT_COLUMNS`: `:gid`, `action`, `ids`, `count`, `:reason`,
    `:actor`, the session's role (`current_user`, evaluated by the insert on the
    server, so no client can write another role's name), `:group_name`, `:topic`."""
    return [
        bindparam("gid", type_=Integer),
        literal(action, Text),
        ids,
        count,
        bindparam("reason", type_=Text),
        bindparam("actor", type_=Text),
        func.current_user(),
        bindparam("group_name", type_=Text),
        bindparam("topic", type_=Text),
    ]


def _audited(action: str, changed: Any) -> Insert:
    """Insert the audit row of `action` for the rows CTE `changed` returned (their
    message ids): the count and at most `:max_listed` ids, the smallest; returns the
    audit row's id and count. When `changed` is empty nothing is inserted and
    nothing returned: an action that changed nothing leaves no trail."""
    count = select(func.count()).select_from(changed).scalar_subquery()
    return (
        insert(audit)
        .from_select(
            list(AUDIT_COLUMNS),
            select(*_audit_values(action, listed_ids(changed), count)).where(
                select(changed.c.message_id).exists()
            ),
        )
        .returning(audit.c.id, audit.c.count)
    )


@cache
def insert_audit(action: str) -> Insert:
    """Insert the audit row of `action` with `:ids` (a JSON array, as text) and
    `:count` (see `_audit_values` for the rest); returns its id. A plain `VALUES`
    insert: on Citus routed to the shard of `:gid`."""
    values = _audit_values(
        action, cast(bindparam("ids", type_=Text), JSONB), bindparam("count", type_=BigInteger)
    )
    return insert(audit).values(dict(zip(AUDIT_COLUMNS, values, strict=True))).returning(audit.c.id)


def _requeue(
    only_ids: bool, of_class: bool = False, matching: frozenset[str] = frozenset()
) -> Executable:
    requeued = (
        update(d)
        .where(*_dead_rows(only_ids, of_class, matching))
        .values(
            state=t.READY,
            available_at=func.now(),
            attempts=0,
            reclaims=0,
            refundable_attempts=0,
            refundable_reclaims=0,
            error_class=None,
            error_epoch=None,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=func.now(),
        )
        .returning(d.c.message_id)
        .cte("requeued")
    )
    return _audited(REQUEUE_ACTION, requeued)


@cache
def requeue_ids() -> Executable:
    """Requeue the dead rows `:ids` of `:gid` and audit it, in one statement.

    Each becomes ready now with attempts, reclaims and refundable charges reset
    and its error class cleared (`last_error` and `refunds` stay). The audit row
    gets `:reason`, `:actor`, the count and at most `:max_listed` ids (the
    smallest). Returns the audit row's id and count; nothing (and no audit row)
    when no row was requeued.
    """
    return _requeue(only_ids=True)


@cache
def requeue_all() -> Executable:
    """`requeue_ids` for every dead row of `:gid` (rows never pass through Python)."""
    return _requeue(only_ids=False)


@cache
def requeue_class() -> Executable:
    """`requeue_all` for the dead rows of `:gid` whose error class is `:cls`.

    Through the partial index on failed rows: `(group_id, error_class)` is its key.
    """
    return _requeue(only_ids=False, of_class=True)


@cache
def requeue_matching(shape: frozenset[str]) -> Executable:
    """`requeue_all` for the dead rows of `:gid` that match a `MessageFilter` of
    `shape` (its values bound as `pgq.sql.messages` names them)."""
    return _requeue(only_ids=False, matching=shape)


@cache
def notify() -> Executable:
    """Wake idle fetchers listening on `:channel` for topic `:topic` (sent at commit)."""
    return select(func.pg_notify(bindparam("channel", type_=Text), bindparam("topic", type_=Text)))


# --- pgq purge ------------------------------------------------------------------


def _purge(
    older: bool, only_ids: bool = False, matching: frozenset[str] = frozenset()
) -> Executable:
    dead = _dead_rows(only_ids, matching=matching)
    if older:
        dead.append(d.c.updated_at < func.now() - bindparam("older_than", type_=Interval))
    purged = d.delete().where(*dead, ~_pending()).returning(d.c.message_id).cte("purged")
    kept = select(func.count().label("n")).where(*dead, _pending()).cte("kept")
    audited = _audited(PURGE_ACTION, purged).cte("audited")
    return select(
        audited.c.id, func.coalesce(audited.c.count, 0).label("count"), kept.c.n.label("kept")
    ).select_from(kept.outerjoin(audited, true()))


@cache
def purge_dead() -> Executable:
    """Delete the dead rows of `:gid` and audit it, in one statement.

    Rows the owed or coming reconciliation will bring back (`:pending_from`,
    `:pending_to`, `:max_refunds`: see `check_dead`) are kept: they are not dead
    letters. The audit row gets `:reason`, `:actor`, the count and at most
    `:max_listed` ids (the smallest); none when nothing was deleted. Returns the
    audit row's id (None without one) and count, and `kept`, the pending rows left.

    `kept` is counted in a CTE of the statement, not in the audit insert's
    `RETURNING`: Citus sends that subquery with the insert to the audit shard
    without its parameters (0023, section 2).
    """
    return _purge(older=False)


@cache
def purge_dead_older() -> Executable:
    """`purge_dead` for the rows whose last change (`updated_at`, the database clock)
    is older than `:older_than`."""
    return _purge(older=True)


@cache
def purge_selected(older: bool, only_ids: bool, matching: frozenset[str]) -> Executable:
    """`purge_dead` (`purge_dead_older` with `older`) for the dead rows `:ids` of
    `:gid` (with `only_ids`) that match a `MessageFilter` of shape `matching`."""
    return _purge(older=older, only_ids=only_ids, matching=matching)


# --- pgq show and pgq audit -----------------------------------------------------


@cache
def message_of_topic() -> Select[Any]:
    """Message `:mid` if it is of topic `:topic_id`: its fields (the dedupe key too,
    schema version 7) and, last, its publishing transaction's xid. Payload and
    headers come as JSON text (the caller decodes them: a payload nested deeper
    than Python's decoder must not fail the read). The first read of `pgq show`;
    on Citus routed to the topic's shard."""
    m = t.message
    return (
        select(
            m.c.id,
            t.topic.c.name.label("topic"),
            m.c.key,
            cast(m.c.payload, Text).label("payload"),
            cast(m.c.headers, Text).label("headers"),
            m.c.created_at,
            m.c.dedupe_key,
            m.c.xid,
        )
        .select_from(m.join(t.topic, t.topic.c.id == m.c.topic_id))
        .where(
            m.c.topic_id == bindparam("topic_id", type_=Integer),
            m.c.id == bindparam("mid", type_=BigInteger),
        )
    )


@cache
def message_in_group() -> Select[Any]:
    """Group `:gid`'s row for message `:mid` (all None without one), whether the
    message is behind the group's frontier, and the newest purge whose audit row
    lists the id. The second read of `pgq show` (after `message_of_topic`); on
    Citus routed to the group's shard.

    Without a delivery row (`has_row` false) `published_after` tells a message
    the group had a row for: it started `earliest` (schema version 6), or the
    message was published after it subscribed (`:message_created_at` at or after
    the group's creation); the row went with its ack (or a purge).
    `behind_frontier` tells a done row the frontier pruned: the message's
    position (`:message_xid`, `:mid`) is at or behind the frontier. On Citus the
    message's xid is the coordinator's and the frontier counts in the group's
    node's xids (0023, section 5), so it is called with `:message_xid` None and
    the id alone is compared.
    """
    gid, mid = bindparam("gid", type_=Integer), bindparam("mid", type_=BigInteger)
    xid = cast(bindparam("message_xid", type_=Text), t.XID8())
    purge = (
        select(audit.c.id, audit.c.at, audit.c.actor, audit.c.reason)
        .where(
            d.c.message_id.is_(None),
            audit.c.group_id == gid,
            audit.c.action == PURGE_ACTION,
            audit.c.message_ids.contains(func.jsonb_build_array(mid)),
        )
        .order_by(audit.c.id.desc())
        .limit(literal_column("1"))
        .lateral("purge")
    )
    behind = and_(
        gs.c.committed_id.is_not(None),
        gs.c.xid_space == SPACE,  # a frontier from another xid space promises nothing
        case(
            (xid.is_(None), mid <= gs.c.committed_id),
            else_=tuple_(xid, mid) <= tuple_(gs.c.committed_xid, gs.c.committed_id),
        ),
    )
    # the group had a row for the message (it started from the earliest retained
    # message, or the message came after it subscribed), so without one the message
    # was finished (the ack deletes what it finishes) or purged
    created_at = bindparam("message_created_at", type_=t.message.c.created_at.type)
    published_after = (
        select(or_(g.c.start == Start.EARLIEST.value, g.c.created_at <= created_at))
        .where(g.c.id == gid)
        .scalar_subquery()
    )
    return (
        select(
            d.c.message_id.is_not(None).label("has_row"),
            d.c.state,
            d.c.attempts,
            d.c.reclaims,
            d.c.refundable_attempts,
            d.c.refundable_reclaims,
            d.c.refunds,
            d.c.error_class,
            d.c.last_error,
            d.c.error_epoch,
            d.c.lease_owner,
            d.c.lease_expires_at,
            d.c.available_at,
            d.c.updated_at,
            func.coalesce(behind, False).label("behind_frontier"),
            purge.c.id.label("purge_audit_id"),
            purge.c.at.label("purged_at"),
            purge.c.actor.label("purged_by"),
            purge.c.reason.label("purge_reason"),
            published_after.label("published_after"),
        )
        .select_from(
            gs.outerjoin(d, and_(d.c.group_id == gs.c.group_id, d.c.message_id == mid)).outerjoin(
                purge, true()
            )
        )
        .where(gs.c.group_id == gid)
    )


AUDIT_TRAILS = ("group", "group_name", "topic")
"""Whose trail `audit_trail` reads: a group by id, a group by the name its rows
keep (one `pgq unsubscribe` removed), or everything about a topic by its name."""


@cache
def audit_trail(of: str = "group") -> Select[Any]:
    """The newest `:limit` audit rows of group `:gid` (`of="group"`), of the group
    named `:name` (`"group_name"`: also after it was removed), or of the topic named
    `:name` (`"topic"`), newest first.

    `message_ids` comes as JSON text (the caller decodes it: whatever a role that
    may insert audit rows wrote there, however deeply nested, must not fail the read).
    """
    if of not in AUDIT_TRAILS:
        raise ValueError(f"unknown audit trail {of!r}")
    whose = (
        audit.c.group_id == bindparam("gid", type_=Integer)
        if of == "group"
        else audit.c[of] == bindparam("name", type_=Text)
    )
    return (
        select(
            audit.c.id,
            audit.c.at,
            audit.c.action,
            audit.c.count,
            cast(audit.c.message_ids, Text).label("message_ids"),
            audit.c.reason,
            audit.c.actor,
            audit.c.role,
            audit.c.group_name,
            audit.c.topic,
        )
        .where(whose)
        .order_by(audit.c.id.desc())
        .limit(bindparam("limit", type_=Integer))
    )


# --- pgq demo -------------------------------------------------------------------


@cache
def clock() -> Select[Any]:
    """The database clock now (`clock_timestamp()`, not the transaction's start)."""
    return select(func.clock_timestamp())


def drop_schema(name: str) -> Executable:
    """Drop schema `name` and everything in it (the demo's scratch schema)."""
    return DropSchema(name, cascade=True, if_exists=True)
