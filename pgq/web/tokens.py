"""Who may change things on the dashboard: one admin token per person, and how
strong a token must be.

`pgq web --admin` reads `name:token` entries, separated by whitespace (one a line
in a file), from `--tokens-file FILE` (`PGQ_WEB_TOKENS_FILE`; a line that
starts with `#` is a comment) and from `PGQ_WEB_TOKENS`; the single token of `PGQ_WEB_TOKEN` is the
person `admin`. The name is what the audit row records (`alice (pgq web)`).
Names are spelled as group names are (`pgq.names.NAME_RE`). A token is at least
16 characters, has no whitespace or control characters, and at least 8
different characters (sixteen spaces, or `aaaa...`, are refused). Nothing here
ever puts a token into a message.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgq.errors import UsageError
from pgq.names import NAME_RE

__all__ = [
    "DEFAULT_USER",
    "MIN_DISTINCT",
    "MIN_TOKEN_LENGTH",
    "TOKENS_ENV",
    "TOKENS_FILE_ENV",
    "TOKEN_ENV",
    "admin_tokens",
    "parse_tokens",
    "weakness",
]

TOKEN_ENV = "PGQ_WEB_TOKEN"
TOKENS_ENV = "PGQ_WEB_TOKENS"
TOKENS_FILE_ENV = "PGQ_WEB_TOKENS_FILE"
DEFAULT_USER = "admin"
"""The person `PGQ_WEB_TOKEN`'s token names."""
MIN_TOKEN_LENGTH = 16
MIN_DISTINCT = 8
RULE = (
    f"at least {MIN_TOKEN_LENGTH} characters, no spaces or control characters,"
    f" at least {MIN_DISTINCT} different characters; for example: openssl rand -hex 16"
)


def weakness(token: str) -> str | None:
    """What makes `token` too weak to guard the dashboard, or None."""
    if len(token) < MIN_TOKEN_LENGTH:
        return f"shorter than {MIN_TOKEN_LENGTH} characters"
    if any(c.isspace() or not c.isprintable() for c in token):
        return "it holds spaces or control characters"
    if len(set(token)) < MIN_DISTINCT:
        return f"fewer than {MIN_DISTINCT} different characters"
    return None


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """`name:token` entries separated by whitespace; a line starting with `#` is a
    comment (a token may hold `#`).
    A bad entry is a `UsageError` naming `source` and the entry's line (never
    its token)."""
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        for entry in line.split():
            name, colon, token = entry.partition(":")
            where = f"{source} line {number}" if "\n" in text.strip() else source
            if not colon or not NAME_RE.fullmatch(name):
                raise UsageError(
                    f"{where}: each entry is NAME:TOKEN, NAME 1-63 letters, digits, '.', '_'"
                    " or '-' (starting with a letter or digit)"
                )
            _add(users, name, token, where)
    return users


def admin_tokens(environ: Mapping[str, str], file_text: str | None = None) -> dict[str, str]:
    """Every person's token, from `PGQ_WEB_TOKEN` (`admin`), `PGQ_WEB_TOKENS` and
    the tokens file's text. Raises `UsageError` when there is none, when one is
    weak, or when a name or a token is given twice."""
    users: dict[str, str] = {}
    if environ.get(TOKEN_ENV) is not None:
        _add(users, DEFAULT_USER, environ[TOKEN_ENV], f"${TOKEN_ENV}")
    sources = [(f"${TOKENS_ENV}", environ.get(TOKENS_ENV))]
    sources.append((f"the tokens file (${TOKENS_FILE_ENV})", file_text))
    for source, text in sources:
        for name, token in parse_tokens(text or "", source).items():
            _add(users, name, token, source)
    if not users:
        raise UsageError(
            f"--admin needs a token: ${TOKEN_ENV}, or NAME:TOKEN entries in ${TOKENS_ENV}"
            f" or --tokens-file ({RULE})"
        )
    return users


def _add(users: dict[str, str], name: str, token: str, where: str) -> None:
    weak = weakness(token)
    if weak is not None:
        raise UsageError(f"{where}: the token of {name!r} is too weak ({weak}): {RULE}")
    if name in users:
        raise UsageError(f"{where}: {name!r} is given a token twice")
    if token in users.values():
        raise UsageError(f"{where}: {name!r} has the same token as another person")
    users[name] = token
