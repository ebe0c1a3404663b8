"""Finding a group's messages: the reads behind the dashboard's messages page.

`find` reads one keyset page of a group's delivery rows that match a
`pgq.records.MessageFilter` (statements in `pgq.sql.messages`, where the
bounded search window is explained); `count_matching` counts the rows a bulk
action would touch, and `fix_matching` also bounds the filter to them.
`check_filter` validates a filter at this boundary, so a bad value is a
`UsageError` (a 400 on the page), never a database error. On Citus the
message side of a filter is read first, as ids (`message_side_as_ids`): the
two tables live on different shards.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection, Engine, Row

from pgq.errors import UsageError
from pgq.read_models import MessagePage, MessageSummary
from pgq.records import MessageFilter, RowState
from pgq.schema import ERROR_CLASSES
from pgq.sql import admin as admin_sql
from pgq.sql import messages as q
from pgq.store.inspect import snapshot
from pgq.store.placement import distributed
from pgq.store.topics import group_info

__all__ = [
    "MAX_MESSAGE_ID",
    "MAX_PAGE",
    "MAX_PATH_DEPTH",
    "MAX_TEXT",
    "SCAN",
    "check_error_class",
    "check_filter",
    "check_message_id",
    "count_matching",
    "dead_filter",
    "filter_params",
    "find",
    "fix_matching",
    "message_side_as_ids",
]

MAX_MESSAGE_ID = 2**63 - 1
"""The largest message id (`bigint`)."""


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


MAX_PAGE = 500
"""The most rows one page holds."""

SCAN = 100_000
"""Rows a page with an unindexed filter (key, payload field, error text, time)
looks through at most before it answers (`pgq.sql.messages`)."""

MAX_TEXT = 1000
"""The longest text a filter takes (a key, a value, an error text, a path)."""

MAX_PATH_DEPTH = 16
"""The most keys a payload path has."""


def _text(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise UsageError(f"invalid {name} filter: give some text")
    if len(value) > MAX_TEXT:
        raise UsageError(f"invalid {name} filter: at most {MAX_TEXT} characters")
    if "\x00" in value:
        raise UsageError(f"invalid {name} filter: no NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"invalid {name} filter: no lone surrogates") from None
    return value


def _time(name: str, value: dt.datetime | None) -> dt.datetime | None:
    if value is not None and (not isinstance(value, dt.datetime) or value.tzinfo is None):
        raise UsageError(f"invalid {name}: give a time with its time zone")
    return value


def check_filter(f: MessageFilter) -> MessageFilter:
    """`f` if every value in it is one a search takes, else `UsageError` naming it."""
    if f.message_id is not None:
        check_message_id(f.message_id)
    if f.up_to is not None:
        check_message_id(f.up_to)
    if f.state is not None and f.state not in {s.value for s in RowState}:
        states = ", ".join(s.value for s in RowState)
        raise UsageError(f"invalid state {f.state!r}: use one of {states}")
    if f.error_class is not None:
        check_error_class(f.error_class)
    for name in ("key", "dedupe_key", "error", "field", "value"):
        _text(name, getattr(f, name))
    if (f.field is None) != (f.value is None):
        raise UsageError("a payload filter needs both a field and a value")
    if f.field is not None:
        path = f.path()
        if len(path) > MAX_PATH_DEPTH or not all(path):
            raise UsageError(
                f"invalid payload field {f.field!r}: keys separated by dots"
                f" (at most {MAX_PATH_DEPTH})"
            )
    _time("published from", f.published_from)
    _time("published to", f.published_to)
    _time("changed by", f.changed_by)
    return f


def filter_params(f: MessageFilter, gid: int, tid: int) -> dict[str, Any]:
    """The bind parameters of filter `f` for group `gid` of topic `tid`
    (`pgq.sql.messages`)."""
    return {
        "gid": gid,
        "tid": tid,
        "f_dedupe_key": f.dedupe_key,
        "f_message_id": f.message_id,
        "f_up_to": f.up_to,
        "f_changed_by": f.changed_by,
        "f_error_class": f.error_class,
        "f_error": f.error,
        "f_key": f.key,
        "f_path": f.path(),
        "f_value": f.value,
        "f_published_from": f.published_from,
        "f_published_to": f.published_to,
    }


def find(
    engine: Engine,
    group: str,
    f: MessageFilter | None = None,
    *,
    after: int | None = None,
    before: int | None = None,
    descending: bool = False,
    limit: int = 50,
    scan: int = SCAN,
) -> MessagePage:
    """One page of `group`'s delivery rows that match `f` (every row without it):
    at most `limit` of them, by message id (`descending`: newest first), only ids
    above `after` and below `before` when given. One snapshot. Raises
    `UnknownGroup`, and `UsageError` for a bad filter or bounds.

    A filter without an index (key, payload field, error text, publishing time)
    and without an exact one (the id, the dedupe key) looks through at most
    `scan` rows past the keyset; a page that ends there without filling up says
    so (`searched_to`), and `more` is then true.
    """
    f = check_filter(f or MessageFilter())
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise UsageError(f"invalid page size {limit!r}: use 1 to {MAX_PAGE}")
    if isinstance(scan, bool) or not isinstance(scan, int) or scan < 1:
        raise UsageError(f"invalid scan {scan!r}: use a positive number of rows")
    for bound in (after, before):
        if bound is not None:
            check_message_id(bound)
    shape = set(f.shape())
    if after is not None:
        shape.add("after")
    if before is not None:
        shape.add("before")
    with snapshot(engine) as conn:
        info = group_info(conn, group)
        params = filter_params(f, info.id, info.topic_id)
        params.update(after=after, before=before, limit=limit + 1, scan=scan)
        bound = None
        if shape & q.UNINDEXED and not shape & q.EXACT:
            ends = conn.execute(q.window_end(frozenset(shape), descending), params).scalars()
            bound = next(iter(ends.all()[:-1]), None)  # only while rows are past it
            if bound is not None:
                shape.add("bound")
                params["bound"] = bound
        rows = _page(conn, frozenset(shape), descending, params)
        now = _now(conn)
    summaries = tuple(MessageSummary(**r) for r in rows[:limit])
    full = len(rows) > limit
    searched_to = bound if bound is not None and not full else None
    return MessagePage(
        group=info.name,
        topic=info.topic,
        rows=summaries,
        descending=descending,
        more=full or searched_to is not None,
        searched_to=searched_to,
        now=now,
    )


def message_side_as_ids(
    conn: Connection, shape: frozenset[str], params: dict[str, Any], descending: bool = False
) -> frozenset[str]:
    """`shape` as the statements on `delivery` alone take it on Citus: its
    message-side filters read first, as the ids `:f_ids` of the topic's messages
    that match (set in `params`), in one statement on the topic's shard. On one
    server, or without such a filter, `shape` as it is (a join does it there)."""
    if not shape & q.MESSAGE_SIDE or not distributed(conn):
        return shape
    params["f_ids"] = list(conn.execute(q.matching_ids(shape, descending), params).scalars())
    return (shape - q.MESSAGE_SIDE) | {q.IN_IDS}


def _page(
    conn: Connection, shape: frozenset[str], descending: bool, params: dict[str, Any]
) -> list[dict[str, Any]]:
    """The rows of a page (`q.PAGE_COLUMNS`): one statement on one server; on Citus
    the message side's ids, the delivery rows, then their messages' columns."""
    if not distributed(conn):
        return [dict(r._mapping) for r in conn.execute(q.page(shape, descending), params)]
    shape = message_side_as_ids(conn, shape, params, descending)
    rows = conn.execute(q.page_rows(shape, descending), params).all()
    ids = [r.message_id for r in rows]
    found = conn.execute(q.bodies(), {"tid": params["tid"], "ids": ids})
    bodies: dict[int, Row[Any]] = {b.id: b for b in found}
    # a row's message is retained while the row is there (retention deletes only
    # what every group finished): a row without one is left out, never half shown
    return [
        {**r._mapping, **{k: getattr(bodies[r.message_id], k) for k in q.BODY_COLUMNS[1:]}}
        for r in rows
        if r.message_id in bodies
    ]


def count_matching(engine: Engine, group: str, f: MessageFilter) -> tuple[int, int | None]:
    """How many of `group`'s delivery rows match `f`, and the highest id among them
    (None when none does). Raises `UnknownGroup`, and `UsageError` for a bad filter."""
    n, fixed = fix_matching(engine, group, f)
    return n, None if fixed is None else fixed.up_to


def fix_matching(engine: Engine, group: str, f: MessageFilter) -> tuple[int, MessageFilter | None]:
    """How many of `group`'s delivery rows match `f`, and `f` bounded to exactly
    those rows as far as rows can be told apart later: `up_to` their highest id
    and `changed_by` their latest `updated_at` (None when none matches). A bulk
    change of the bounded filter leaves alone the rows published, and the rows
    dead, after this count (decision 0041). Raises `UnknownGroup`, and
    `UsageError` for a bad filter."""
    check_filter(f)
    with snapshot(engine) as conn:
        info = group_info(conn, group)
        params = filter_params(f, info.id, info.topic_id)
        shape = message_side_as_ids(conn, f.shape(), params)
        row = conn.execute(q.count_matching(shape), params).one()
    if row.up_to is None:
        return int(row.n), None
    return int(row.n), replace(f, up_to=int(row.up_to), changed_by=row.changed_by)


def dead_filter(f: MessageFilter) -> MessageFilter:
    """`f` narrowed to dead rows: what a bulk requeue or purge acts on."""
    return replace(f, state=RowState.DEAD.value)


def _now(conn: Connection) -> dt.datetime:
    value: dt.datetime = conn.execute(admin_sql.clock()).scalar_one()
    return value
