"""What users type besides names and JSON: message ids and ages (`pgq requeue`,
`pgq purge`, `pgq show`, `pgq check`, and the same fields of `pgq web`'s forms and URLs).

Each parser returns the value or raises `UsageError` with one line that says
what was wrong and what to use instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from pgq.errors import UsageError
from pgq.settings import MAX_DURATION, parse_duration
from pgq.store.admin import MAX_MESSAGE_ID, MAX_OLDER_THAN

__all__ = ["parse_age", "parse_ids", "parse_max_age", "parse_message_id"]


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


def parse_max_age(text: str) -> tuple[float, float | None]:
    """`pgq check --max-age WARN[,CRIT]`: the seconds of each, durations as the
    settings take them (`900`, `15m`, `1h30m`), each above 0 and CRIT not below
    WARN; no CRIT (None) when only WARN is given. Else `UsageError`."""
    parts = text.split(",")
    try:
        if len(parts) > 2:
            raise ValueError(text)
        limits = [parse_duration(part) for part in parts]
    except ValueError:
        limits = [-1.0]
    if not all(0 < limit <= MAX_DURATION for limit in limits) or limits != sorted(limits):
        raise UsageError(
            f"invalid --max-age {text[:40]!r}: use WARN[,CRIT], seconds or durations"
            " such as 15m,1h (above 0, CRIT not below WARN)"
        )
    return limits[0], (limits[1] if len(limits) == 2 else None)
