"""What names pgq accepts: topics, groups and members (DESIGN §7)."""

from __future__ import annotations

import re

from pgq.errors import InvalidName, UsageError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""Topic and group names, matched as a whole string (a trailing newline is no match)."""

MEMBER_NAME_MAX = 200


def check_name(kind: str, name: object) -> str:
    """Return `name` if it is a valid topic or group name, else raise `InvalidName`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidName(
            f"invalid {kind} name {name!r}: 1-63 characters of letters, digits, '.', '_' or '-',"
            " starting with a letter or digit"
        )
    return name


def check_member_name(name: str) -> str:
    """Return `name` if it is a valid member name (1-200 printable characters, no
    control characters), else raise `UsageError`."""
    if not isinstance(name, str) or not 0 < len(name) <= MEMBER_NAME_MAX:
        raise UsageError(f"invalid member name: 1-{MEMBER_NAME_MAX} characters")
    if not name.isprintable():
        raise UsageError(
            f"invalid member name {name!r}: printable characters only (no control characters)"
        )
    return name
