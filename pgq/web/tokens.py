"""Who may change things on the dashboard: one admin token per person, and how
strong a token must be.

`pgq web --admin` reads `name:token` entries, separated by whitespace (one a line
in a file), from `--tokens-file FILE` (`PGQ_WEB_TOKENS_FILE`; a line that
starts with `#` is a comment) and from `PGQ_WEB_TOKENS`; the single token of `PGQ_WEB_TOKEN` is the
person `admin`. The name is what the audit row records (`alice (pgq web)`).
Names are spelled as group names are (`pgq.names.NAME_RE`). A token is at least
16 characters, has no whitespace or control characters, at least 8 different
characters (sixteen spaces, or `aaaa...`, are refused), and an estimated
strength of at least 64 bits (`strength`): each character counts the bits of
the alphabet the token draws from (lower case 26 letters, upper case 26, digits
10, other ASCII 33, anything else 100), except one a guesser would try next,
which counts 1 bit: the next of a run (`abc`, `987`), the next key of a
keyboard row (`qwerty`, `asdf`), a repeat of the character before or of a
piece already seen (`changeme-changeme`), the rest of a common word
(`password`). So `0123456789abcdef`, `qwertyuiopasdfgh` and `password12345678`
are refused; `openssl rand -hex 16` (about 160 bits) always passes. Nothing
here ever puts a token into a message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pgq.errors import UsageError
from pgq.names import NAME_RE

__all__ = [
    "DEFAULT_USER",
    "MIN_BITS",
    "MIN_DISTINCT",
    "MIN_TOKEN_LENGTH",
    "TOKENS_ENV",
    "TOKENS_FILE_ENV",
    "TOKEN_ENV",
    "admin_tokens",
    "parse_tokens",
    "strength",
    "weakness",
]

TOKEN_ENV = "PGQ_WEB_TOKEN"
TOKENS_ENV = "PGQ_WEB_TOKENS"
TOKENS_FILE_ENV = "PGQ_WEB_TOKENS_FILE"
DEFAULT_USER = "admin"
"""The person `PGQ_WEB_TOKEN`'s token names."""
MIN_TOKEN_LENGTH = 16
MIN_DISTINCT = 8
MIN_BITS = 64
RULE = (
    f"at least {MIN_TOKEN_LENGTH} characters, no spaces or control characters,"
    f" at least {MIN_DISTINCT} different characters, and at least {MIN_BITS} bits"
    " estimated (runs, keyboard rows, repeats and common words count little);"
    " for example: openssl rand -hex 16"
)
ALPHABETS = {"lower": 26, "upper": 26, "digit": 10, "punctuation": 33, "other": 100}
"""How many characters each kind of character is drawn from."""
KEYBOARD_ROWS = ("`1234567890-=", "qwertyuiop[]\\", "asdfghjkl;'", "zxcvbnm,./")
COMMON_WORDS = (
    "password",
    "passwd",
    "changeme",
    "letmein",
    "welcome",
    "secret",
    "admin",
    "token",
    "qwerty",
    "dragon",
    "monkey",
    "master",
    "login",
    "default",
    "iloveyou",
    "trustno",
    "test",
    "root",
    "pgq",
)
"""Words a guesser tries first (lower case; matched in any case)."""


def _alphabet(token: str) -> int:
    """How many characters the kinds of character in `token` span."""
    kinds: set[str] = set()
    for c in token:
        if not c.isascii():
            kinds.add("other")
        elif c.islower():
            kinds.add("lower")
        elif c.isupper():
            kinds.add("upper")
        elif c.isdigit():
            kinds.add("digit")
        else:
            kinds.add("punctuation")
    return sum(ALPHABETS[kind] for kind in kinds)


def _follows(before: str, c: str) -> bool:
    """Whether `c` is what a guesser tries after `before`: a repeat, the next of a
    run either way, or the next key of a keyboard row either way."""
    if before.isascii() and c.isascii():
        before, c = before.lower(), c.lower()
    if c == before or abs(ord(c) - ord(before)) == 1:
        return True
    return any(
        before in row and c in row and abs(row.index(c) - row.index(before)) == 1
        for row in KEYBOARD_ROWS
    )


def strength(token: str) -> float:
    """Estimated bits of `token` (see the module docstring)."""
    bits = math.log2(_alphabet(token)) if token else 0.0
    lower = token.lower()
    predictable = [False] * len(token)
    for i in range(len(token)):
        for word in COMMON_WORDS:
            if lower.startswith(word, i):
                for j in range(i + 1, i + len(word)):
                    predictable[j] = True
        if i and _follows(token[i - 1], token[i]):
            predictable[i] = True
        if i >= 1 and token[i - 1 : i + 1] in token[:i]:
            predictable[i] = True  # a piece already seen, from its second character
    return sum(1.0 if p else bits for p in predictable)


def weakness(token: str) -> str | None:
    """What makes `token` too weak to guard the dashboard, or None."""
    if len(token) < MIN_TOKEN_LENGTH:
        return f"shorter than {MIN_TOKEN_LENGTH} characters"
    if any(c.isspace() or not c.isprintable() for c in token):
        return "it holds spaces or control characters"
    if len(set(token)) < MIN_DISTINCT:
        return f"fewer than {MIN_DISTINCT} different characters"
    bits = strength(token)
    if bits < MIN_BITS:
        return f"guessable: about {math.floor(bits)} bits estimated"
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
