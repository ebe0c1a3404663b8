"""Failure classification: what a handler's exception means (DESIGN §5).

`default_classify` maps an exception to ``"permanent"`` (`PermanentError`),
``"systemic"`` (a dependency is failing: connection and timeout errors,
HTTP 429/502/503/504 errors of requests and httpx, anywhere on the
cause/context chain) or ``"message"`` (anything else).
Third-party errors are recognised by class name over the MRO, so requests,
httpx, urllib3, psycopg, psycopg2 and SQLAlchemy are never imported here.
`make_classifier` wraps a user ``classify`` hook with a safe fallback.

`RetryLater` is not a failure; the consumer handles it before classifying.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable, Iterator
from typing import Literal

from pgq.errors import PermanentError, SystemicError
from pgq.logcontext import get_logger

__all__ = [
    "CLASSIFICATIONS",
    "SYSTEMIC_HTTP_STATUSES",
    "Classification",
    "default_classify",
    "make_classifier",
]

log = get_logger(__name__)

Classification = Literal["systemic", "message", "permanent"]
_BY_NAME: dict[str, Classification] = {
    "systemic": "systemic",
    "message": "message",
    "permanent": "permanent",
}
CLASSIFICATIONS: frozenset[str] = frozenset(_BY_NAME)

_SYSTEMIC_TYPES: tuple[type[BaseException], ...] = (
    SystemicError,
    ConnectionError,
    TimeoutError,
    socket.gaierror,
)

# (package, class qualname): matches a class of that name defined in the package
# or any of its submodules (httpx defines its errors in httpx._exceptions,
# psycopg in psycopg.errors, requests in requests.exceptions).
_SYSTEMIC_NAMES: frozenset[tuple[str, str]] = frozenset(
    (
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
        ("httpx", "TransportError"),
        ("httpx", "ConnectError"),
        ("httpx", "TimeoutException"),
        ("httpx", "NetworkError"),
        ("urllib3", "NewConnectionError"),
        ("urllib3", "ConnectTimeoutError"),
        ("urllib3", "ReadTimeoutError"),
        ("urllib3", "MaxRetryError"),
        ("urllib3", "ProtocolError"),
        ("psycopg", "OperationalError"),
        ("psycopg", "ConnectionTimeout"),
        ("psycopg2", "OperationalError"),
        ("sqlalchemy", "OperationalError"),
        ("sqlalchemy", "DisconnectionError"),
        ("sqlalchemy", "TimeoutError"),
    )
)

# HTTP errors that carry the response: systemic when its status says the dependency is
# unavailable (rate limited, bad gateway, unavailable, gateway timeout), not the message.
_HTTP_STATUS_NAMES: frozenset[tuple[str, str]] = frozenset(
    (
        ("requests", "HTTPError"),
        ("httpx", "HTTPStatusError"),
    )
)
SYSTEMIC_HTTP_STATUSES: frozenset[int] = frozenset((429, 502, 503, 504))
"""HTTP statuses of a requests/httpx error that classify it as systemic by default."""

# Conflicts with other transactions (serialization failures, deadlocks) are
# OperationalErrors in psycopg, but they say nothing about the dependency's health:
# the message's own work lost a race and a plain retry is right.
_CONFLICT_NAMES: frozenset[tuple[str, str]] = frozenset(
    (
        ("psycopg", "TransactionRollback"),
        ("psycopg", "SerializationFailure"),
        ("psycopg", "DeadlockDetected"),
        ("psycopg2", "TransactionRollbackError"),
    )
)

# How many exceptions of one chain to look at; chains are short, cycles are not.
_MAX_CHAIN = 32


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """Yield `exc` and what it was raised from or while handling, as a traceback shows it.

    Follows ``__cause__`` and, unless suppressed (``raise ... from None``),
    ``__context__``; each exception once, at most `_MAX_CHAIN` of them.
    """
    seen: set[int] = set()
    todo = deque([exc])
    while todo and len(seen) < _MAX_CHAIN:
        current = todo.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            todo.append(current.__cause__)
        if current.__context__ is not None and not current.__suppress_context__:
            todo.append(current.__context__)


def _names(cls: type[BaseException]) -> Iterator[tuple[str, str]]:
    for klass in cls.__mro__:
        yield klass.__module__.partition(".")[0], klass.__qualname__


def _is_conflict(exc: BaseException) -> bool:
    """A transaction conflict: by class name, or SQLSTATE class 40 (transaction rollback)."""
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if isinstance(code, str) and code.startswith("40"):
        return True
    return any(name in _CONFLICT_NAMES for name in _names(type(exc)))


def _is_systemic_type(cls: type[BaseException]) -> bool:
    if issubclass(cls, _SYSTEMIC_TYPES):
        return True
    return any(name in _SYSTEMIC_NAMES for name in _names(cls))


def _is_unavailable_response(exc: BaseException) -> bool:
    """A requests `HTTPError` or httpx `HTTPStatusError` whose `response.status_code`
    is one of `SYSTEMIC_HTTP_STATUSES` (matched by name: neither library is imported)."""
    if not any(name in _HTTP_STATUS_NAMES for name in _names(type(exc))):
        return False
    try:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    except Exception:  # a response object that cannot say: not evidence of an outage
        return False
    return isinstance(status, int) and status in SYSTEMIC_HTTP_STATUSES


def _is_systemic(exc: BaseException) -> bool:
    return _is_systemic_type(type(exc)) or _is_unavailable_response(exc)


def default_classify(exc: BaseException) -> Classification:
    """Classify a handler's exception as ``"permanent"``, ``"systemic"`` or ``"message"``.

    A `PermanentError` itself is permanent, whatever it was raised from. Systemic
    when the exception or anything on its cause/context chain is a
    `SystemicError`, `ConnectionError`, `TimeoutError`, `socket.gaierror`, or a
    connection/timeout error of requests, httpx, urllib3, psycopg, psycopg2 or
    SQLAlchemy (matched by name), or an HTTP error of requests or httpx whose
    response status is 429, 502, 503 or 504, unless the chain holds a transaction conflict
    (serialization failure, deadlock): that is the message's own race, a
    message failure. Anything else is a message failure.
    """
    if isinstance(exc, PermanentError):
        return "permanent"
    chain = list(_chain(exc))
    if any(_is_conflict(e) for e in chain):
        return "message"
    if any(_is_systemic(e) for e in chain):
        return "systemic"
    return "message"


def make_classifier(
    user: Callable[[BaseException], object] | None,
) -> Callable[[BaseException], Classification]:
    """Return a classifier that asks `user` first and falls back to the default.

    The user's answer wins whenever it is one of the three classifications
    (even ``"systemic"`` for a `PermanentError`). If the hook raises or returns
    anything else, a warning is logged and `default_classify` decides.
    """
    if user is None:
        return default_classify
    hook = user

    def classify(exc: BaseException) -> Classification:
        try:
            result = hook(exc)
        except Exception as hook_exc:
            fallback = default_classify(exc)
            log.warning(
                "classify hook failed: hook=%r exc_type=%s error=%r fallback=%s",
                hook,
                type(exc).__qualname__,
                hook_exc,
                fallback,
            )
            return fallback
        found = _BY_NAME.get(result) if isinstance(result, str) else None
        if found is not None:
            return found
        fallback = default_classify(exc)
        log.warning(
            "classify hook returned an invalid value: hook=%r value=%r exc_type=%s fallback=%s",
            hook,
            result,
            type(exc).__qualname__,
            fallback,
        )
        return fallback

    return classify
