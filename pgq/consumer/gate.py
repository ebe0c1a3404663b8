"""The member's breaker gate: its local breaker plus what it knows of the group's.

The gate answers two questions: may the fetcher claim (and how much), and may a
buffered row start an attempt. While the local breaker or the group breaker is
open, both answers are no, except for probes: one local probe at a time while
only the local breaker is open, and none while the group is open (the group's
prober is then the only traffic).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Literal

from pgq.breaker import LocalBreaker
from pgq.logcontext import get_logger
from pgq.records import BreakerState, Claimed, ErrorClass, Outcome, OutcomeKind
from pgq.settings import Settings

logger = get_logger("pgq.breaker")

RAMP_SECONDS = 5.0
"""After a group close, claims grow from one row to the full pool over this long."""

ClaimMode = Literal["normal", "probe", "closed"]

# read once per message: an enum member read through its class costs 0.1 us
# (`EnumType.__getattr__` makes every class attribute lookup slow)
DONE, SNOOZE, SYSTEMIC = OutcomeKind.DONE, OutcomeKind.SNOOZE, ErrorClass.SYSTEMIC


class Gate:
    """Local breaker state, the group state last seen, and the gating decisions."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        s = settings
        self.local = LocalBreaker(
            window=s.breaker_window,
            min_calls=s.breaker_min_calls,
            failure_rate=s.breaker_failure_rate,
            open_for=s.breaker_open_for,
            open_for_max=s.breaker_open_for_max,
            clock=clock,
        )
        self.clock = clock
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.group_state: str = BreakerState.CLOSED
        self.group_open = False
        """The group breaker is OPEN (as last seen; `see_group` keeps it)."""
        self.epoch = 0
        self.tripped_epoch: int | None = None
        self._closed_at: float | None = None
        self.events: Callable[[str, dict[str, object]], None] | None = None
        """Told of each transition (name, attributes): the member's span events
        (`pgq.otel`), when it traces."""

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever a breaker changes (the fetcher wakes, the heartbeat
        reports at once)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def _event(self, name: str, **attributes: object) -> None:
        """A transition, for `events` (one per transition: never on the hot path)."""
        if self.events is not None:
            self.events(name, {f"pgq.breaker.{k}": v for k, v in attributes.items()})

    def nudge(self) -> None:
        """Tell the listeners to look again (a worker turned a row away)."""
        self._changed()

    # -- what the threads ask ------------------------------------------------------

    def is_open(self) -> bool:
        """True while either breaker is open: claim nothing, start nothing."""
        return self.group_open or self.local.is_open

    def claim_mode(self) -> ClaimMode:
        """How the fetcher may claim now: normally, one local probe, or not at all."""
        if self.group_open:
            return "closed"
        if self.local.is_open:
            return "probe" if self.local.try_probe() else "closed"
        return "normal"

    def ramp(self, capacity: int) -> int:
        """The most rows to hold right after a group close (ramping up to `capacity`)."""
        closed_at = self._closed_at
        if closed_at is None:
            return capacity
        elapsed = self.clock() - closed_at
        if elapsed >= RAMP_SECONDS:
            self._closed_at = None
            return capacity
        return max(1, math.ceil(capacity * elapsed / RAMP_SECONDS))

    def admit(self, row: Claimed) -> bool:
        """May this buffered row start an attempt? A local probe may while only the
        local breaker is open; nothing may while the group is open (its prober's
        probes are the only traffic then)."""
        if self.group_open:
            return False
        return row.probe or not self.local.is_open

    # -- what the threads report ----------------------------------------------------

    def observe(self, outcome: Outcome) -> None:
        """Feed a finished attempt to the local breaker (workers call this)."""
        row = outcome.claimed
        systemic = outcome.error_class == SYSTEMIC
        if row.probe:
            if outcome.kind == SNOOZE:
                self.local.abandon_probe()
            elif outcome.kind == DONE:
                self.local.probe_result("success")
                logger.info("local breaker closed after a successful probe id=%d", row.id)
                self._event("pgq.breaker.local_closed", epoch=self.epoch)
                self._changed()
            elif systemic:
                self.local.probe_result("systemic")
                with self._lock:
                    self.tripped_epoch = self.epoch
                self._event("pgq.breaker.local_probe_failed", epoch=self.epoch)
                self._changed()
            else:
                self.local.probe_result("inconclusive")
            return
        if outcome.kind == SNOOZE or row.epoch != self.epoch or self.group_open:
            return  # snoozes, attempts from an older epoch, and the open group do not count
        if self.local.record(systemic):
            with self._lock:
                self.tripped_epoch = self.epoch
            logger.warning(
                "local breaker tripped epoch=%d trips=%d (systemic failures)",
                self.epoch,
                self.local.trips,
            )
            self._event("pgq.breaker.local_open", epoch=self.epoch, trips=self.local.trips)
            self._changed()

    def probe_not_claimed(self) -> None:
        """The fetcher found no row for a local probe."""
        self.local.abandon_probe()

    def released(self, rows: list[Claimed]) -> None:
        """These rows went back unstarted: a local probe among them never ran, so the
        local breaker may probe again (it would otherwise wait for it for good)."""
        if any(row.probe for row in rows):
            self.local.abandon_probe()

    def see_group(self, state: str, epoch: int, by: str | None = None) -> bool:
        """Take in the group state read from the database; True if it changed. The
        change is logged here, once per transition; `by`: what this member did to
        make it (`quorum`, `probe`, `nothing_to_probe`)."""
        cause = {} if by is None else {"by": by}
        with self._lock:
            if epoch == self.epoch and state == self.group_state:
                return False
            if epoch < self.epoch:
                return False
            was_open = self.group_state == BreakerState.OPEN
            self.group_state, self.epoch = state, epoch
            self.group_open = state == BreakerState.OPEN
        if state == BreakerState.OPEN:
            logger.warning("group breaker open epoch=%d", epoch, extra=cause)
            self._event("pgq.breaker.group_open", epoch=epoch, **cause)
        elif was_open:
            self._event("pgq.breaker.group_closed", epoch=epoch, **cause)
            logger.info("group breaker closed epoch=%d", epoch, extra=cause)
            self._closed_at = self.clock()
            if self.local.is_open:
                self.local.probe_now()  # re-verify ourselves at once; the close does not heal us
            else:
                self.local.forget_window()  # pre-outage failures do not count again
        self._changed()
        return True

    def local_report(self) -> tuple[str, int | None]:
        """What the heartbeat records: ("open"|"closed", epoch of the trip)."""
        with self._lock:
            return self.local.state, self.tripped_epoch
