"""Running the handler on one row and turning what happened into an `Outcome`.

Workers and the prober both call `run_handler`; nothing here touches the
database or the breaker.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from pgq.backoff import retry_delay
from pgq.classify import Classification
from pgq.errors import RetryLater
from pgq.records import Claimed, Message, Outcome
from pgq.settings import Settings

logger = logging.getLogger("pgq.consumer")

MAX_SNOOZE = 30 * 86400.0
"""The longest `RetryLater` delay: 30 days."""


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
        """Run the handler on `row` and return its outcome; never raises."""
        try:
            self.handler(row.message)
        except BaseException as exc:  # a handler's SystemExit must not kill the thread
            outcome = self.failure(row, exc)
            logger.debug("handler failed id=%d outcome=%s error=%r", row.id, outcome.kind, exc)
            return outcome
        return Outcome(row, "done")

    def failure(self, row: Claimed, exc: BaseException) -> Outcome:
        """The outcome of an attempt on `row` that raised `exc`: snooze, retry or dead."""
        error_class = None
        if isinstance(exc, RetryLater):
            if math.isfinite(exc.delay) and 0.0 <= exc.delay <= MAX_SNOOZE:
                return Outcome(row, "snooze", delay=exc.delay)
            error_class = "message"
            text = f"RetryLater: delay must be finite, from 0 to 30 days; got {exc.delay!r}"
        else:
            text = f"{type(exc).__name__}: {_text_of(exc)}"
        error_class = error_class or self.classify(exc)
        finished = row.attempts + 1
        s = self.settings
        if error_class == "permanent" or finished >= s.max_attempts:
            return Outcome(row, "dead", error_class=error_class, error=text)
        delay = retry_delay(finished, s.retry_backoff, s.retry_backoff_max)
        return Outcome(row, "retry", delay=delay, error_class=error_class, error=text)


def _text_of(exc: BaseException) -> str:
    """`str(exc)`, or a placeholder when the exception cannot even say what it is."""
    try:
        return str(exc)
    except Exception:
        return "<the exception's text could not be read>"
