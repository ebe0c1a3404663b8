"""Audited administration of dead rows, and the demo's housekeeping.

`requeue` (behind `pgq requeue`) turns dead rows back to ready and writes its
audit row in the same statement.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from pgq.errors import UsageError
from pgq.schema import ERROR_CLASSES
from pgq.sql import admin as q
from pgq.sql.publish import notify_channel
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.topics import group_info

MAX_LISTED_IDS = 10_000
"""Most message ids one audit row lists; `count` always has the full number."""

MAX_MESSAGE_ID = 2**63 - 1
"""The largest message id (`bigint`)."""

_SHOWN_INVALID = 20


@dataclass(frozen=True, slots=True)
class RequeueResult:
    """What one requeue did: how many rows, and the audit row that records it."""

    count: int
    audit_id: int


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


def _reason(reason: str | None, action: str) -> str:
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


def check_message_id(message_id: object) -> int:
    """`message_id` if it is an int in `1..MAX_MESSAGE_ID`, else raise `UsageError`."""
    if isinstance(message_id, bool) or not isinstance(message_id, int):
        raise UsageError(f"invalid message id {message_id!r}: use a positive integer")
    if not 1 <= message_id <= MAX_MESSAGE_ID:
        raise UsageError(
            f"invalid message id {message_id}: use a positive integer up to {MAX_MESSAGE_ID}"
        )
    return message_id


def check_error_class(error_class: str) -> str:
    """`error_class` if it is one of `systemic`, `message`, `permanent`, `lease`."""
    if error_class not in ERROR_CLASSES:
        raise UsageError(
            f"invalid error class {error_class!r}: use one of {', '.join(ERROR_CLASSES)}"
        )
    return error_class


def requeue(
    engine: Engine,
    group: str,
    ids: Sequence[int] | None = None,
    *,
    all_dead: bool = False,
    error_class: str | None = None,
    reason: str,
    actor: str | None = None,
    max_listed: int = MAX_LISTED_IDS,
) -> RequeueResult:
    """Requeue dead rows of `group` (the ones in `ids`, or every one with `all_dead`,
    only those of `error_class` when given).

    Each row becomes ready now: attempts, reclaims and refundable charges reset
    to 0, error class cleared; `last_error` and `refunds` stay. One `audit` row
    records the group, action `requeue`, the ids (at most `max_listed`, the
    smallest), the full count, `reason` and `actor` (default `user@host`). All
    in one transaction. Raises `UsageError` for bad arguments (an id outside
    `1..MAX_MESSAGE_ID`, a reason that is empty or holds a NUL byte or a lone
    surrogate, an `error_class` without `all_dead`), and when any of `ids` is
    not a dead row of the group (`not dead: 12, 13`): then nothing is written.
    With `all_dead` the rows never pass through Python, so any number of them
    works in bounded memory.
    """
    if (ids is None or len(ids) == 0) == (not all_dead):
        raise UsageError("requeue takes either ids or all_dead=True (not both)")
    if error_class is not None:
        if not all_dead:
            raise UsageError("an error class selects among all dead rows: use it with all_dead")
        check_error_class(error_class)
    wanted = [check_message_id(i) for i in dict.fromkeys(ids or ())]
    params: dict[str, Any] = {
        "reason": _reason(reason, "requeue"),
        "actor": actor or default_actor(),
        "max_listed": max_listed,
    }
    with wrap_errors(), engine.begin() as conn:
        info = group_info(conn, group)
        params["gid"] = info.id
        if error_class is not None:
            params["cls"] = error_class
            statement = q.requeue_class()
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
        audit_id, count = conn.execute(statement, params).one()
        if count:
            channel = notify_channel(schema_of(engine))
            conn.execute(q.notify(), {"channel": channel, "topic": info.topic})
    return RequeueResult(count=int(count), audit_id=int(audit_id))


def database_now(engine: Engine) -> Any:
    """The database clock (`now()`): the time leases and retries are measured in."""
    with wrap_errors(), engine.connect() as conn:
        return conn.execute(q.clock()).scalar_one()


def drop_schema(engine: Engine, schema: str) -> None:
    """Drop `schema` and everything in it (the demo cleans up after itself)."""
    with wrap_errors(), engine.begin() as conn:
        conn.execute(q.drop_schema(schema))
