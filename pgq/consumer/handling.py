"""The user's handler: finding it by name, running it on one row and turning what
happened into an `Outcome`.

Workers and the prober both call `run_handler`; nothing here touches the
database or the breaker. `load_handler` imports a handler named
`MODULE:FUNCTION`, as `pgq consume --handler` and the orchestrator recipes do.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from pgq.backoff import retry_delay
from pgq.classify import Classification
from pgq.errors import HandlerImportError, RetryLater
from pgq.logcontext import get_logger
from pgq.otel import tracing as otel
from pgq.records import Claimed, ErrorClass, Message, Outcome, OutcomeKind
from pgq.settings import Settings

logger = get_logger("pgq.consumer")

DONE = OutcomeKind.DONE
"""Read once: an enum member read through its class costs 0.1 us, once per message here."""

MAX_SNOOZE = 30 * 86400.0
"""The longest `RetryLater` delay: 30 days."""


def load_handler(path: str) -> Callable[..., Any]:
    """The handler named `path`, `MODULE:FUNCTION` (`FUNCTION` may be dotted:
    `module:Class.method`), as `pgq consume --handler` takes it.

    The current directory is importable, as with `python -m`. Raises
    `HandlerImportError` (a `UsageError`) when the name is malformed, the module
    cannot be imported (whatever it raised, `SystemExit` included), the attribute
    is missing or is not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerImportError(f"invalid handler {path!r}: use MODULE:FUNCTION")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    # a module that calls sys.exit() or raises KeyboardInterrupt; any other
    # BaseException (the CLI's stop during start-up) is not the module's fault
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        raise HandlerImportError(
            f"cannot import handler module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    target: object = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise HandlerImportError(f"handler {path!r}: {module_name} has no {attr!r}")
    if not callable(target):
        raise HandlerImportError(f"handler {path!r} is not callable")
    return target


class Handling:
    """The user's handler and classifier, and the settings that turn failures into
    retries or dead letters."""

    def __init__(
        self,
        handler: Callable[[Message], Any],
        classify: Callable[[BaseException], Classification],
        settings: Settings,
    ) -> None:
        self.handler = handler
        self.classify = classify
        self.settings = settings

    def run(self, row: Claimed) -> Outcome:
        """Run the handler on `row` and return its outcome; never raises.

        A row whose message could not be decoded never reaches the handler: it
        fails as `permanent` (no retry can make it readable)."""
        if row.unreadable is not None:
            return Outcome(
                row, OutcomeKind.DEAD, error_class=ErrorClass.PERMANENT, error=row.unreadable
            )
        started = time.monotonic()
        try:
            self.handler(row.message)
        except BaseException as exc:  # a handler's SystemExit must not kill the thread
            outcome = self.failure(row, exc)._replace(seconds=time.monotonic() - started)
            logger.debug("handler failed id=%d outcome=%s", row.id, outcome.kind)
            return outcome
        return Outcome(row, DONE)

    def failure(self, row: Claimed, exc: BaseException) -> Outcome:
        """The outcome of an attempt on `row` that raised `exc`: snooze, retry or dead.

        Never raises: an exception that cannot be read or classified (its attributes
        raise, its delay is no number) fails the attempt as `message`, saying so.
        With the `otel` extra, `exc` is an event of the current span (the call's).
        """
        if otel.TRACING and not isinstance(exc, RetryLater):
            otel.record_exception(exc)
        try:
            return self._failure(row, exc)
        except Exception as broken:
            text = (
                f"{_name_of(exc)}: the failure could not be classified"
                f" ({_name_of(broken)}: {_text_of(broken)})"
            )
            return self._charged(row, ErrorClass.MESSAGE, text)

    def _failure(self, row: Claimed, exc: BaseException) -> Outcome:
        if isinstance(exc, RetryLater):
            delay = _number(exc.delay)
            if delay is not None and 0.0 <= delay <= MAX_SNOOZE:
                return Outcome(row, OutcomeKind.SNOOZE, delay=delay)
            text = (
                "RetryLater: delay must be a finite number of seconds from 0 to 30 days;"
                f" got {_repr_of(exc.delay)}"
            )
            return self._charged(row, ErrorClass.MESSAGE, text)
        return self._charged(row, self.classify(exc), f"{_name_of(exc)}: {_text_of(exc)}")

    def _charged(self, row: Claimed, error_class: str, text: str) -> Outcome:
        """A finished, failed attempt: a retry with backoff, or dead."""
        finished = row.attempts + 1
        s = self.settings
        if error_class == ErrorClass.PERMANENT or finished >= s.max_attempts:
            return Outcome(row, OutcomeKind.DEAD, error_class=error_class, error=text)
        delay = retry_delay(finished, s.retry_backoff, s.retry_backoff_max)
        return Outcome(row, OutcomeKind.RETRY, delay=delay, error_class=error_class, error=text)


def _text_of(exc: BaseException) -> str:
    """`str(exc)`, or a placeholder when the exception cannot even say what it is."""
    try:
        return str(exc)
    except Exception:
        return "<the exception's text could not be read>"


def _name_of(exc: BaseException) -> str:
    return type(exc).__name__


def _number(value: object) -> float | None:
    """`value` as a finite float, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _repr_of(value: object) -> str:
    try:
        return repr(value)[:100]
    except Exception:
        return f"<a {type(value).__name__}>"
