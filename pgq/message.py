"""The objects handlers and callers see: `Message` and `RunSummary`."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal

StopReason = Literal["empty", "max_messages", "max_runtime", "signal", "breaker_open"]
"""Why a run ended. `signal`: asked to stop from outside (SIGTERM/SIGINT, `stop()`)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message as a handler receives it. `attempt` is 1-based."""

    id: int
    topic: str
    group: str
    key: str | None
    payload: Any
    headers: dict[str, Any] | None
    attempt: int
    created_at: dt.datetime


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What one `Consumer.run()` did.

    `handled` counts finished attempts; `done`, `retried` and `dead` split them
    by outcome (a snooze is in `retried`); `released` counts rows handed back
    unstarted, `reclaimed` rows this member took back from expired leases, and
    `waiting_retry` the group's rows waiting for a later retry when the run ended.
    """

    handled: int
    done: int
    retried: int
    dead: int
    released: int
    reclaimed: int
    waiting_retry: int
    stop_reason: StopReason
