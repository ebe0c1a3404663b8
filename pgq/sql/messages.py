"""Statements that find a group's messages: the dashboard's messages page.

A page is keyset-paginated on the message id (`delivery`'s primary key is
`(group_id, message_id)`), so page 10,000 costs what page 1 does. The filters
of a `pgq.records.MessageFilter` split in two:

- on the delivery row, cheap or indexed: the id, the state (a literal, so that
  the partial indexes of ready, leased and failed rows can serve it) and the
  error class (a key of the failed-rows index); `up_to`;
- on the message, indexed: the dedupe key (`message_dedupe_key_idx` on
  `(topic_id, dedupe_key)`, so the topic `:tid` is said too): at most one
  retained message of the topic has it, so no window is needed (`EXACT`);
- read row by row, without an index (no schema change for search): the key, a
  payload field, the error text, the publishing time, the last change.

A page with only the first kind walks the primary key (or one of those indexes)
until it has its rows. With the second kind a sparse match could walk the whole
group, so such a page examines a bounded window instead: `window_end` finds the
id `:scan` rows on (by the first kind's filters alone, an index-only walk), and
the page looks only up to there; the page then says how far it searched, and
the next one continues from there. Measured on 1,000,000 rows in
`docs/benchmarks.md` ("Issue 23").

On Citus `message` (by topic) and `delivery` (by group) are not co-located, and
a join of the two is a repartition join, which Citus refuses. There the store
reads the message side first, in one statement on the topic's shard
(`matching_ids`), and gives the ids to the delivery side as `:f_ids` (shape
`IN_IDS` instead of the message-side fields): a page is then `page_rows` on the
group's shard and `bodies` on the topic's; a count, a requeue and a purge read
`delivery` alone.

Every statement is built once per filter shape and direction (`functools.cache`);
the values are bind parameters named `f_<field>` (`f_path` for the payload
field's keys): never like a column, which an UPDATE given that parameter would
also SET (`pgq.sql.admin` requeues by these filters).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import BigInteger, Integer, Text, any_, bindparam, func, literal_column, select
from sqlalchemy.dialects.postgresql import ARRAY, TIMESTAMP
from sqlalchemy.sql import ColumnElement, Executable, Select

from pgq import schema as t
from pgq.records import RowState

__all__ = [
    "ERROR_SHOWN",
    "EXACT",
    "IN_IDS",
    "KEYSET",
    "MESSAGE_SIDE",
    "PAYLOAD_SHOWN",
    "UNINDEXED",
    "bodies",
    "count_matching",
    "delivery_matches",
    "matching_ids",
    "message_matches",
    "page",
    "page_rows",
    "window_end",
]

d, m = t.delivery, t.message

ERROR_SHOWN = 300
"""Characters of the last error a page row carries (the message page has it all)."""

PAYLOAD_SHOWN = 160
"""Characters of the payload's JSON text a page row carries."""

UNINDEXED = frozenset(
    {"key", "error", "field", "value", "published_from", "published_to", "changed_by"}
)
"""The filters read row by row (see the module docstring): a page with any of them
looks through a bounded window."""

MESSAGE_SIDE = frozenset({"key", "dedupe_key", "field", "value", "published_from", "published_to"})
"""The filters on `message` (`message_matches`)."""

IN_IDS = "message_in"
"""The shape word of a filter whose message side is given as the ids `:f_ids`."""

EXACT = frozenset({"message_id", "dedupe_key"})
"""The filters that match at most one row through an index: a page with one of them
needs no window, whatever else it has."""


def _word(state: str) -> ColumnElement[Any]:
    return literal_column(f"'{RowState(state).value}'", Text)


def delivery_matches(shape: frozenset[str]) -> list[ColumnElement[bool]]:
    """The conditions on `delivery` alone of a filter of `shape`, for group `:gid`."""
    where: list[ColumnElement[bool]] = [d.c.group_id == bindparam("gid", type_=Integer)]
    if "message_id" in shape:
        where.append(d.c.message_id == bindparam("f_message_id", type_=BigInteger))
    if "up_to" in shape:
        where.append(d.c.message_id <= bindparam("f_up_to", type_=BigInteger))
    if IN_IDS in shape:
        where.append(d.c.message_id == any_(bindparam("f_ids", type_=ARRAY(BigInteger))))
    for word in RowState:
        if f"state={word.value}" in shape:
            where.append(d.c.state == _word(word.value))
            if word is RowState.DEAD:  # always true: lets the failed-rows index serve it
                where.append(d.c.error_class.is_not(None))
    if "error_class" in shape:
        where.append(d.c.error_class == bindparam("f_error_class", type_=Text))
    if "changed_by" in shape:
        where.append(d.c.updated_at <= bindparam("f_changed_by", type_=TIMESTAMP(True)))
    if "error" in shape:
        needle = func.lower(bindparam("f_error", type_=Text))
        where.append(func.strpos(func.lower(d.c.last_error), needle) > 0)
    return where


def message_matches(shape: frozenset[str]) -> list[ColumnElement[bool]]:
    """The conditions on `message` of a filter of `shape` (the caller relates the
    message to its delivery row)."""
    where: list[ColumnElement[bool]] = []
    if "key" in shape:
        where.append(m.c.key == bindparam("f_key", type_=Text))
    if "dedupe_key" in shape:  # the partial unique index's key and predicate
        where.append(m.c.topic_id == bindparam("tid", type_=Integer))
        where.append(m.c.dedupe_key == bindparam("f_dedupe_key", type_=Text))
        where.append(m.c.dedupe_key.is_not(None))
    if "field" in shape:
        path = bindparam("f_path", type_=ARRAY(Text))
        where.append(m.c.payload.op("#>>")(path) == bindparam("f_value", type_=Text))
    if "published_from" in shape:
        where.append(m.c.created_at >= bindparam("f_published_from", type_=TIMESTAMP(True)))
    if "published_to" in shape:
        where.append(m.c.created_at < bindparam("f_published_to", type_=TIMESTAMP(True)))
    return where


KEYSET = frozenset({"after", "before", "bound"})
"""Bounds a page adds to the filter's shape: ids after `:after`, before `:before`,
and up to `:bound` (down to it, descending: the window's end). Each is in the
statement only when given, never as `:x IS NULL OR ...`, which a prepared
statement's generic plan could not use as an index bound."""


def _bounds(
    shape: frozenset[str], descending: bool, column: ColumnElement[Any] = d.c.message_id
) -> list[ColumnElement[bool]]:
    where = []
    if "after" in shape:
        where.append(column > bindparam("after", type_=BigInteger))
    if "before" in shape:
        where.append(column < bindparam("before", type_=BigInteger))
    if "bound" in shape:
        bound = bindparam("bound", type_=BigInteger)
        where.append(column >= bound if descending else column <= bound)
    return where


def _order(descending: bool) -> ColumnElement[Any]:
    return d.c.message_id.desc() if descending else d.c.message_id.asc()


@cache
def window_end(shape: frozenset[str], descending: bool) -> Select[Any]:
    """The id `:scan` rows on from the keyset (`:after`/`:before` when in `shape`),
    counting only the rows the delivery-side filters of `shape` keep, and the id
    after it: two rows while rows are left past the window, else fewer (then the
    window is the rest of the group).

    The text filters (and `changed_by`) are left out on purpose: this walk is what
    bounds a page's cost, so it must not itself read every row's error text.
    """
    cheap = shape - {"error", "changed_by", "bound"}
    return (
        select(d.c.message_id)
        .where(*delivery_matches(cheap), *_bounds(cheap, descending))
        .order_by(_order(descending))
        .offset(bindparam("scan", type_=Integer) - 1)
        .limit(2)
    )


PAGE_COLUMNS = (
    "message_id",
    "state",
    "attempts",
    "reclaims",
    "refunds",
    "error_class",
    "error",
    "available_at",
    "updated_at",
    "lease_owner",
    "key",
    "created_at",
    "payload",
)
"""What `page` returns, in order (the store maps its rows by these names)."""


def _row_columns() -> list[ColumnElement[Any]]:
    return [
        d.c.message_id,
        d.c.state,
        d.c.attempts,
        d.c.reclaims,
        d.c.refunds,
        d.c.error_class,
        func.left(d.c.last_error, ERROR_SHOWN).label("error"),
        d.c.available_at,
        d.c.updated_at,
        d.c.lease_owner,
    ]


@cache
def page(shape: frozenset[str], descending: bool) -> Select[Any]:
    """Up to `:limit` delivery rows of group `:gid` that match a filter of `shape`,
    in message id order (`descending`: newest first), within the keyset bounds in
    `shape` (`KEYSET`; `:bound` is `window_end`'s), with their message's key,
    publishing time and the start of its payload (`PAGE_COLUMNS`)."""
    columns = [
        *_row_columns(),
        m.c.key,
        m.c.created_at,
        func.left(func.cast(m.c.payload, Text), PAYLOAD_SHOWN).label("payload"),
    ]
    assert tuple(c.key for c in columns) == PAGE_COLUMNS
    return (
        select(*columns)
        .select_from(d.join(m, m.c.id == d.c.message_id))
        .where(
            *delivery_matches(shape),
            *message_matches(shape),
            *_bounds(shape, descending),
            # the same bounds on the message's id: without them the planner may
            # merge-join the page with every message below the keyset (measured:
            # 177 ms from id 900,000 of 1,000,000, against 2 ms for the first page)
            *_bounds(shape, descending, m.c.id),
        )
        .order_by(_order(descending))
        .limit(bindparam("limit", type_=Integer))
    )


@cache
def count_matching(shape: frozenset[str]) -> Executable:
    """How many delivery rows of group `:gid` match a filter of `shape`, the highest
    id and the latest `updated_at` among them (a bulk action's confirmation shows
    the one and fixes the others as the filter's `up_to` and `changed_by`)."""
    counted = select(
        func.count().label("n"),
        func.max(d.c.message_id).label("up_to"),
        func.max(d.c.updated_at).label("changed_by"),
    )
    on_message = message_matches(shape)
    if on_message:
        counted = counted.select_from(d.join(m, m.c.id == d.c.message_id))
    return counted.where(*delivery_matches(shape), *on_message)


@cache
def matching_ids(shape: frozenset[str], descending: bool) -> Select[Any]:
    """The ids of topic `:tid`'s messages that match the message side of a filter
    of `shape`, within its id bounds (`f_message_id`, `f_up_to`, and the keyset's
    `KEYSET` as `page` reads them), in list order. On Citus one task on the topic's
    shard of `message` (the first read of a page, a count or a bulk change there)."""
    return (
        select(m.c.id)
        .where(
            m.c.topic_id == bindparam("tid", type_=Integer),
            *message_matches(shape),
            *(
                [m.c.id == bindparam("f_message_id", type_=BigInteger)]
                if "message_id" in shape
                else []
            ),
            *([m.c.id <= bindparam("f_up_to", type_=BigInteger)] if "up_to" in shape else []),
            *_bounds(shape, descending, m.c.id),
        )
        .order_by(m.c.id.desc() if descending else m.c.id.asc())
    )


ROW_COLUMNS = PAGE_COLUMNS[:10]
"""What `page_rows` returns: `PAGE_COLUMNS` without the message's own."""

BODY_COLUMNS = ("id", *PAGE_COLUMNS[10:])
"""What `bodies` returns: the message id and the rest of `PAGE_COLUMNS`."""


@cache
def page_rows(shape: frozenset[str], descending: bool) -> Select[Any]:
    """`page` without the message's columns and without the join: the delivery side
    of a page (on Citus one task on the group's shard; the message side comes as
    `:f_ids`, shape `IN_IDS`)."""
    columns = _row_columns()
    assert tuple(c.key for c in columns) == ROW_COLUMNS
    assert not shape & MESSAGE_SIDE, shape
    return (
        select(*columns)
        .where(*delivery_matches(shape), *_bounds(shape, descending))
        .order_by(_order(descending))
        .limit(bindparam("limit", type_=Integer))
    )


@cache
def bodies() -> Select[Any]:
    """The key, publishing time and start of the payload of topic `:tid`'s messages
    `:ids` (`BODY_COLUMNS`): a page's second read on Citus, on the topic's shard."""
    columns = [
        m.c.id,
        m.c.key,
        m.c.created_at,
        func.left(func.cast(m.c.payload, Text), PAYLOAD_SHOWN).label("payload"),
    ]
    assert tuple(c.key for c in columns) == BODY_COLUMNS
    return select(*columns).where(
        m.c.topic_id == bindparam("tid", type_=Integer),
        m.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
    )
