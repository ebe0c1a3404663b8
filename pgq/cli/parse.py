"""What users type besides names and JSON: message ids and ages (`pgq requeue`,
`pgq purge`, `pgq show`, and the same fields of `pgq web`'s forms and URLs).

Each parser returns the value or raises `UsageError` with one line that says
what was wrong and what to use instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from pgq.errors import UsageError
from pgq.settings import parse_duration
from pgq.store.admin import MAX_MESSAGE_ID, MAX_OLDER_THAN

__all__ = ["parse_age", "parse_ids", "parse_message_id"]


def parse_message_id(text: str) -> int:
    """The message id in `text`: ASCII digits, 1 to 2**63 - 1; else `UsageError`."""
    digits = text.strip()
    numeric = digits.isascii() and digits.isdigit() and len(digits) <= 19
    if not numeric or not 1 <= int(digits) <= MAX_MESSAGE_ID:
        raise UsageError(
            f"invalid message id {digits[:40]!r}: use a positive integer up to {MAX_MESSAGE_ID}"
        )
    return int(digits)


def parse_ids(values: Iterable[str]) -> list[int]:
    """Message ids from `--id` values (each one id or a comma-separated list), deduplicated.

    Raises `UsageError` naming the first value that is not a valid message id.
    """
    ids: dict[int, None] = {}
    for value in values:
        for part in value.split(","):
            ids[parse_message_id(part)] = None
    return list(ids)


def parse_age(text: str) -> float:
    """Seconds in `--older-than`: a number of seconds or a duration such as `7d`,
    `12h`, `30m`, `90s`, from 0 to 100 years; else `UsageError`."""
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_OLDER_THAN:
        raise UsageError(
            f"invalid --older-than {text[:40]!r}: use seconds or a duration"
            " such as 7d, 12h, 30m, 90s (at most 100 years)"
        )
    return seconds
