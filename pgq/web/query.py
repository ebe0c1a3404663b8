"""The messages page's URL: its filters and where the page starts, read and written.

Everything that chooses what the page shows is in the query string, so a link
can be shared: `id`, `key`, `dedupe` (the dedupe key), `state`, `class`,
`error` (part of the error text), `field` and `value` (a payload field's
value), `from` and `to` (publishing time,
ISO 8601; without an offset it is UTC, as `<input type="datetime-local">` sends
it), `order` (`asc`, the default, or `desc`), `limit`, and one of `next` (the
page that follows that message id in the list's order) or `prev` (the page
that precedes it). Pure: no I/O, tested alone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass

from pgq.errors import UsageError
from pgq.records import MessageFilter

__all__ = ["FILTER_ARGS", "PAGE_SIZES", "Position", "filter_args", "parse_filter", "parse_position"]

PAGE_SIZES = (25, 50, 100, 200, 500)
"""The page sizes offered (`limit`); any of 1..500 is taken."""

FILTER_ARGS = {
    "id": "message_id",
    "key": "key",
    "dedupe": "dedupe_key",
    "state": "state",
    "class": "error_class",
    "error": "error",
    "field": "field",
    "value": "value",
    "from": "published_from",
    "to": "published_to",
    "upto": "up_to",
    "changed": "changed_by",
}
"""Query argument -> `MessageFilter` field."""

_INTS = frozenset({"message_id", "up_to"})
_TIMES = frozenset({"published_from", "published_to", "changed_by"})


def _int(arg: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise UsageError(f"invalid {arg}: use a message id (a positive integer)")
    return int(text)


def _time(arg: str, text: str) -> dt.datetime:
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"invalid {arg}: use an ISO 8601 time (2026-01-31T14:05)") from None
    when = when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)
    try:  # the filter form shows it in UTC: year 1 east of UTC is year 0 there
        when.astimezone(dt.timezone.utc)
    except OverflowError:
        raise UsageError(f"invalid {arg}: use a time of the years 1 to 9999 in UTC") from None
    return when


def parse_filter(args: Mapping[str, str]) -> MessageFilter:
    """The filter the query arguments `args` ask for (empty ones are not given);
    `UsageError` for a value that is no id or time (the store checks the rest)."""
    values: dict[str, object] = {}
    for arg, name in FILTER_ARGS.items():
        text = args.get(arg, "")
        if text == "":
            continue
        if name in _INTS:
            values[name] = _int(arg, text.strip())
        elif name in _TIMES:
            values[name] = _time(arg, text.strip())
        else:
            values[name] = text
    return MessageFilter(**values)  # type: ignore[arg-type]


def filter_args(f: MessageFilter) -> dict[str, str]:
    """`f` as query arguments (`parse_filter` reads them back to `f`)."""
    args = {}
    for arg, name in FILTER_ARGS.items():
        value = getattr(f, name)
        if value is None:
            continue
        args[arg] = value.isoformat() if isinstance(value, dt.datetime) else str(value)
    return args


@dataclass(frozen=True, slots=True)
class Position:
    """Where a page starts: list order, size, and `next` or `prev` of a message id."""

    descending: bool = False
    limit: int = 50
    next: int | None = None
    prev: int | None = None

    def bounds(self) -> tuple[int | None, int | None, bool, bool]:
        """(after, before, descending, reversed) for `pgq.store.messages.find`: a
        `prev` page is read in the other direction and shown reversed."""
        if self.prev is not None:
            after, before = (self.prev, None) if self.descending else (None, self.prev)
            return after, before, not self.descending, True
        if self.next is not None:
            after, before = (None, self.next) if self.descending else (self.next, None)
            return after, before, self.descending, False
        return None, None, self.descending, False

    def args(self) -> dict[str, str]:
        """The order and size as query arguments (defaults left out)."""
        args = {}
        if self.descending:
            args["order"] = "desc"
        if self.limit != 50:
            args["limit"] = str(self.limit)
        return args


def parse_position(args: Mapping[str, str]) -> Position:
    """The page position the query arguments ask for; `UsageError` for bad ones."""
    order = args.get("order", "asc") or "asc"
    if order not in ("asc", "desc"):
        raise UsageError("invalid order: use asc or desc")
    limit_text = args.get("limit", "") or "50"
    limit = _int("limit", limit_text)
    if not 1 <= limit <= PAGE_SIZES[-1]:
        raise UsageError(f"invalid limit: use 1 to {PAGE_SIZES[-1]}")
    nxt, prev = args.get("next", ""), args.get("prev", "")
    if nxt and prev:
        raise UsageError("give next or prev, not both")
    return Position(
        descending=order == "desc",
        limit=limit,
        next=_int("next", nxt) if nxt else None,
        prev=_int("prev", prev) if prev else None,
    )
