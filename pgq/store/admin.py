"""Audited administration of dead rows, and the reads beside it.

`requeue` and `purge` (behind `pgq requeue` and `pgq purge`) change dead rows
and write their audit row in one statement; `message_row` and `audit_rows` read
one message with its delivery row (`pgq show`) and the audit trail (`pgq audit`).
"""

from __future__ import annotations

import datetime as dt
import getpass
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from sqlalchemy import Engine, Row

from pgq.breaker import pending_scope
from pgq.errors import UnknownGroup, UnknownTopic, UsageError
from pgq.names import check_name
from pgq.records import GroupInfo, MessageFilter, RowState
from pgq.settings import DEFAULTS
from pgq.sql import admin as q
from pgq.sql.locks import breaker_flip_key, xact_lock_shared
from pgq.sql.publish import notify_channel, topic_id
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.inspect import snapshot
from pgq.store.messages import MAX_MESSAGE_ID as MAX_MESSAGE_ID
from pgq.store.messages import check_error_class as check_error_class
from pgq.store.messages import check_filter, filter_params, message_side_as_ids
from pgq.store.messages import check_message_id as check_message_id
from pgq.store.placement import Spanning, distributed, spanning
from pgq.store.topics import group_info

MAX_LISTED_IDS = 10_000
"""Most message ids one audit row lists; `count` always has the full number."""

MAX_OLDER_THAN = 100 * 365 * 86400.0
"""The longest `older_than` a purge takes (a hundred years, in seconds)."""

MAX_AUDIT_LIMIT = 2**31 - 1
"""The most audit rows one read returns."""

_SHOWN_INVALID = 20


@dataclass(frozen=True, slots=True)
class RequeueResult:
    """What one requeue did: how many rows, and the audit row that records it (None
    when it requeued nothing: then it wrote none)."""

    count: int
    audit_id: int | None


def default_actor() -> str:
    """`user@host` of whoever runs this (for the audit row)."""
    try:
        user = getpass.getuser()
    except Exception:  # no USER/LOGNAME and no passwd entry (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _id_list(ids: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:_SHOWN_INVALID])
    more = len(ids) - _SHOWN_INVALID
    return f"{shown} and {more} more" if more > 0 else shown


def check_reason(reason: str | None, action: str) -> str:
    """`reason` with its whitespace collapsed; `UsageError` when it is empty or holds
    what the database cannot store (a NUL byte, a lone surrogate)."""
    why = " ".join((reason or "").split())
    if not why:
        raise UsageError(f"a {action} needs a non-empty reason")
    if "\x00" in why or _unencodable(why):
        raise UsageError(f"the {action} reason must be text without NUL bytes or lone surrogates")
    return why


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def requeue(
    engine: Engine,
    group: str,
    ids: Sequence[int] | None = None,
    *,
    all_dead: bool = False,
    error_class: str | None = None,
    matching: MessageFilter | None = None,
    reason: str,
    actor: str | None = None,
    max_listed: int = MAX_LISTED_IDS,
) -> RequeueResult:
    """Requeue dead rows of `group` (the ones in `ids`, or every one with `all_dead`,
    only those of `error_class` when given).

    Each row becomes ready now: attempts, reclaims and refundable charges reset
    to 0, error class cleared; `last_error` and `refunds` stay. One `audit` row
    records the group, action `requeue`, the ids (at most `max_listed`, the
    smallest), the full count, `reason`, `actor` (default `user@host`) and the
    database role; a requeue that matched no row writes none. All in one
    transaction. Raises `UsageError` for bad arguments (an id outside
    `1..MAX_MESSAGE_ID`, a reason that is empty or holds a NUL byte or a lone
    surrogate, an `error_class` without `all_dead`), and when any of `ids` is
    not a dead row of the group (`not dead: 12, 13`): then nothing is written.
    With `all_dead` the rows never pass through Python, so any number of them
    works in bounded memory. `matching` (with `all_dead`) keeps only the dead rows
    that match that filter (the dashboard's "every dead row that matches"; its
    `state` is ignored: only dead rows are requeued).
    """
    if (ids is None or len(ids) == 0) == (not all_dead):
        raise UsageError("requeue takes either ids or all_dead=True (not both)")
    if error_class is not None or matching is not None:
        if not all_dead:
            raise UsageError(
                "an error class or a filter selects among all dead rows: use it with all_dead"
            )
    if error_class is not None:
        if matching is not None:
            raise UsageError("give the error class in the filter")
        check_error_class(error_class)
    wanted = [check_message_id(i) for i in dict.fromkeys(ids or ())]
    params: dict[str, Any] = {
        "reason": check_reason(reason, "requeue"),
        "actor": actor or default_actor(),
        "max_listed": max_listed,
    }
    with wrap_errors(), engine.begin() as conn:
        info = group_info(conn, group)
        params.update(audit_names(info))
        if info.ordered:
            conn.execute(q.lock_key_successors(), {"gid": info.id})
        if error_class is not None:
            params["cls"] = error_class
            statement = q.requeue_class()
        elif matching is not None:
            f = _dead_only(matching)
            params.update(filter_params(f, info.id, info.topic_id))
            statement = q.requeue_matching(message_side_as_ids(conn, f.shape(), params))
        elif all_dead:
            statement = q.requeue_all()
        else:
            found = set(conn.execute(q.lock_dead_ids(), {"gid": info.id, "ids": wanted}).scalars())
            missing = [i for i in wanted if i not in found]
            if missing:
                raise UsageError(
                    f"not dead: {_id_list(missing)} (not dead rows of group {group!r};"
                    " nothing requeued)"
                )
            params["ids"] = wanted
            statement = q.requeue_ids()
        row = conn.execute(statement, params).one_or_none()
        if row is None:
            return RequeueResult(count=0, audit_id=None)
        audit_id, count = row
        channel = notify_channel(schema_of(engine))
        conn.execute(q.notify(), {"channel": channel, "topic": info.topic})
    return RequeueResult(count=int(count), audit_id=int(audit_id))


@dataclass(frozen=True, slots=True)
class PurgeResult:
    """What one purge did: rows deleted, dead rows kept because a reconciliation
    will bring them back, and the audit row that records it (None when it deleted
    nothing: then it wrote none)."""

    count: int
    kept: int
    audit_id: int | None


def _older_than(seconds: float | None) -> dt.timedelta | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise UsageError(f"invalid age {seconds!r}: use a number of seconds")
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_OLDER_THAN):
        raise UsageError(
            f"invalid age {seconds!r}: use 0 to {MAX_OLDER_THAN:.0f} seconds (100 years)"
        )
    return dt.timedelta(seconds=seconds)


def purge(
    engine: Engine,
    group: str,
    *,
    older_than: float | None = None,
    ids: Sequence[int] | None = None,
    matching: MessageFilter | None = None,
    reason: str,
    max_refunds: int = int(DEFAULTS["breaker_max_refunds"]),
    actor: str | None = None,
    max_listed: int = MAX_LISTED_IDS,
) -> PurgeResult:
    """Delete the dead rows of `group` (only those last changed more than
    `older_than` seconds ago by the database clock, when given); audited.

    Dead rows that the group's owed or coming reconciliation will refund
    (charged by the outage, fewer than `max_refunds` refunds: the rows
    `pgq check` counts as pending) are kept and counted in `kept`: they are not
    dead letters. No other row is touched. One `audit` row (action `purge`)
    records the count, at most `max_listed` ids (the smallest), `reason`,
    `actor` and the database role, written by the same statement as the delete:
    both or neither (a purge that deleted nothing writes none).
    First it takes the group's breaker-flip lock shared (an open takes it
    exclusively), so the breaker it reads cannot open before the delete commits:
    rows an outage is about to refund are never purged on a stale view. A dead
    row that a reconciliation or a requeue changes meanwhile is rechecked by
    the delete and left alone; the audit row lists exactly the rows deleted.
    Why deleting a dead row is safe for the frontier and retention:
    `docs/decisions/0017-purge.md`. Raises `UsageError` for bad arguments.

    `ids` and `matching` narrow it (the dashboard's selection and "every dead
    row that matches", the filter's `state` ignored): only those dead rows; an
    id that is not a dead row of the group is left out, as a row that changed
    meanwhile is.
    """
    if ids is not None and not ids:
        raise UsageError("give the message ids to purge")
    wanted = None if ids is None else [check_message_id(i) for i in dict.fromkeys(ids)]
    params: dict[str, Any] = {
        "reason": check_reason(reason, "purge"),
        "actor": actor or default_actor(),
        "max_listed": max_listed,
        "max_refunds": max_refunds,
    }
    age = _older_than(older_than)
    with wrap_errors(), engine.connect() as conn, conn.begin():
        conn.execute(xact_lock_shared(breaker_flip_key(schema_of(conn), group)))
        info = group_info(conn, group)
        params.update(audit_names(info))
        row = conn.execute(q.check_group(), {"gid": params["gid"]}).one()
        scope = pending_scope(
            row.state, int(row.epoch), row.reconcile_epoch, row.reconcile_from_epoch
        )
        params["pending_from"], params["pending_to"] = scope or (None, None)
        if age is not None:
            params["older_than"] = age
        if wanted is not None or matching is not None:
            f = _dead_only(matching or MessageFilter())
            params.update(filter_params(f, info.id, info.topic_id), ids=wanted)
            shape = message_side_as_ids(conn, f.shape(), params)
            statement = q.purge_selected(age is not None, wanted is not None, shape)
        elif age is None:
            statement = q.purge_dead()
        else:
            statement = q.purge_dead_older()
        audit_id, count, kept = conn.execute(statement, params).one()
    return PurgeResult(
        count=int(count), kept=int(kept), audit_id=None if audit_id is None else int(audit_id)
    )


def _dead_only(f: MessageFilter) -> MessageFilter:
    """Filter `f`, checked, for dead rows (what requeue and purge act on)."""
    return check_filter(replace(f, state=RowState.DEAD.value))


def message_row(engine: Engine, group: str, message_id: int) -> MessageRow | None:
    """Message `message_id` of `group`'s topic with the group's delivery row (see
    `pgq.sql.admin.message_in_group`), or None when there is no such message.

    Raises `UnknownGroup`, and `UsageError` for an id outside `1..MAX_MESSAGE_ID`.
    """
    mid = check_message_id(message_id)
    with snapshot(engine) as conn:
        info = group_info(conn, group)
        found = conn.execute(q.message_of_topic(), {"topic_id": info.topic_id, "mid": mid})
        message = found.one_or_none()
        if message is None:
            return None
        xid = None if distributed(conn) else message.xid
        params = {
            "gid": info.id,
            "mid": mid,
            "message_xid": xid,
            "message_created_at": message.created_at,
        }
        row = conn.execute(q.message_in_group(), params).one_or_none()
        if row is None:  # no group_state row (a group subscribed by a version before 4)
            return None
        return MessageRow(*message[:-1], *row)


class MessageRow(NamedTuple):
    """A message and its group's row, as `pgq.monitor.message` reads them."""

    id: int
    topic: str
    key: str | None
    payload: str
    headers: str | None
    created_at: dt.datetime
    dedupe_key: str | None
    has_row: bool
    state: str | None
    attempts: int | None
    reclaims: int | None
    refundable_attempts: int | None
    refundable_reclaims: int | None
    refunds: int | None
    error_class: str | None
    last_error: str | None
    error_epoch: int | None
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    available_at: dt.datetime | None
    updated_at: dt.datetime | None
    behind_frontier: bool
    purge_audit_id: int | None
    purged_at: dt.datetime | None
    purged_by: str | None
    purge_reason: str | None
    published_after: bool


def audit_names(info: GroupInfo) -> dict[str, Any]:
    """The parameters that name group `info` in its audit rows (`q.AUDIT_COLUMNS`)."""
    return {"gid": info.id, "group_name": info.name, "topic": info.topic}


def audit_rows(
    engine: Engine, group: str | None, limit: int, *, topic: str | None = None
) -> list[Row[Any]]:
    """The newest `limit` audit rows of `group` (or, with `topic` instead, every row
    about the topic and its groups), newest first; `message_ids` as JSON text.

    A group `pgq unsubscribe` removed is read by the name its rows keep; raises
    `UnknownGroup` (`UnknownTopic`) when there is neither such a group (topic) nor
    a row that names it.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_AUDIT_LIMIT:
        raise UsageError(f"invalid limit {limit!r}: use 0 to {MAX_AUDIT_LIMIT}")
    if (group is None) == (topic is None):
        raise UsageError("give a group or a topic (not both)")
    with snapshot(engine) as conn:
        if topic is not None:
            check_name("topic", topic)
            with spanning(conn, Spanning.AUDIT_BY_NAME):
                trail = conn.execute(q.audit_trail("topic"), {"name": topic, "limit": limit})
                found = list(trail)
            if not found and conn.execute(topic_id(), {"name": topic}).first() is None:
                raise UnknownTopic(f"unknown topic {topic!r}")
            return found
        assert group is not None
        try:
            gid = group_info(conn, group).id
        except UnknownGroup:
            by_name = q.audit_trail("group_name")
            with spanning(conn, Spanning.AUDIT_BY_NAME):
                found = list(conn.execute(by_name, {"name": group, "limit": max(limit, 1)}))
            if not found:
                raise
            return found[:limit]
        return list(conn.execute(q.audit_trail(), {"gid": gid, "limit": limit}))


def database_now(engine: Engine) -> Any:
    """The database clock (`now()`): the time leases and retries are measured in."""
    with wrap_errors(), engine.connect() as conn:
        return conn.execute(q.clock()).scalar_one()


def drop_schema(engine: Engine, schema: str) -> None:
    """Drop `schema` and everything in it (the demo cleans up after itself)."""
    with wrap_errors(), engine.begin() as conn:
        conn.execute(q.drop_schema(schema))
