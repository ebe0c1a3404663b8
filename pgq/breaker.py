"""Circuit breaker logic: pure, no I/O, no database.

`LocalBreaker` is one member's local breaker (DESIGN §6.1): a sliding window
of finished attempts that trips on a share of systemic failures, then lets one
probe through after an open period that doubles on each failed probe.
`trip_threshold`, `group_should_open` and `probe_delay` are the arithmetic of
the group's global breaker (DESIGN §6.2 and §6.4). The database side (the
quorum statement, the probe lock, close and reconcile) lives elsewhere; it
calls into this module and nothing here touches a connection.

Time comes from an injected monotonic clock and randomness from an injected
``rng() -> [0, 1)``, so tests can drive every transition exactly.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Literal

from pgq import records
from pgq.backoff import capped_exponential, jitter

__all__ = [
    "BreakerState",
    "LeadMove",
    "LocalBreaker",
    "ProbeOutcome",
    "ProbeVerdict",
    "group_should_open",
    "judge_probe",
    "lead_move",
    "needs_prober",
    "probe_delay",
    "should_try_open",
    "trip_threshold",
]

BreakerState = Literal["open", "closed"]
"""A local breaker's state: the values of `pgq.records.LocalBreakerState`."""
ProbeOutcome = Literal["success", "systemic", "inconclusive"]
_OUTCOMES: frozenset[str] = frozenset(("success", "systemic", "inconclusive"))


class LocalBreaker:
    """One member's local circuit breaker (DESIGN §6.1).

    Closed, it keeps the last `window` finished attempts (True = systemic) and
    trips when at least `min_calls` are recorded and the systemic share is at
    least `failure_rate`. Open, it lets exactly one probe through once the open
    period has passed (`try_probe`) and waits for `probe_result`. "Half-open" is
    open with `probe_in_flight`.

    The open period is `open_for` after a trip and doubles on each failed probe
    up to `open_for_max`; each period is multiplied by a jitter factor in
    [0.5, 1) drawn from `rng`. Jitter only shortens, so `open_for_max` is a hard
    cap, and members that tripped together on the same outage probe at spread
    times rather than in lockstep.

    Thread-safe: workers report from several threads.
    """

    def __init__(
        self,
        *,
        window: int = 20,
        min_calls: int = 5,
        failure_rate: float = 0.5,
        open_for: float = 5.0,
        open_for_max: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_calls <= window:
            raise ValueError(f"min_calls must be in [1, window={window}], got {min_calls}")
        if not 0 < failure_rate <= 1:
            raise ValueError(f"failure_rate must be in (0, 1], got {failure_rate}")
        if not 0 < open_for <= open_for_max:
            raise ValueError(
                f"need 0 < open_for <= open_for_max, got {open_for} and {open_for_max}"
            )
        self._min_calls = min_calls
        self._failure_rate = failure_rate
        self._open_for = open_for
        self._open_for_max = open_for_max
        self._clock = clock
        self._rng = rng
        self._lock = threading.Lock()
        self._calls: deque[bool] = deque(maxlen=window)
        self._systemic = 0  # systemic entries currently in _calls
        self._open = False
        self._opened_at: float | None = None
        self._probe_at: float | None = None
        self._failed_probes = 0
        self._in_flight = False
        self._trips = 0

    # --- reporting ------------------------------------------------------------

    def record(self, systemic: bool) -> bool:
        """Record a finished attempt; return True if this call tripped the breaker.

        Ignored while open: attempts that finish after the trip (started before
        it) say nothing new, and the probe reports through `probe_result`.
        Snoozes and inconclusive probes must not be recorded.
        """
        with self._lock:
            if self._open:
                return False
            if len(self._calls) == self._calls.maxlen and self._calls[0]:
                self._systemic -= 1
            self._calls.append(systemic)
            self._systemic += systemic
            n = len(self._calls)
            # Float division is correctly rounded, so a rate written as 0.3 or 0.1
            # compares as the fraction it was meant to be (3/10 >= 0.3 holds).
            if n >= self._min_calls and self._systemic / n >= self._failure_rate:
                self._open = True
                self._opened_at = self._clock()
                self._failed_probes = 0
                self._in_flight = False
                self._trips += 1
                self._start_period(self._opened_at)
                return True
            return False

    def try_probe(self) -> bool:
        """Return True, once, when open and the open period has passed.

        A True marks a probe in flight: the caller runs one real message and
        reports it with `probe_result` (or `abandon_probe` if it never ran).
        """
        with self._lock:
            if not self._open or self._in_flight:
                return False
            assert self._probe_at is not None
            if self._clock() < self._probe_at:
                return False
            self._in_flight = True
            return True

    def probe_result(self, outcome: ProbeOutcome) -> None:
        """Report the probe's outcome.

        - ``"success"``: close; the window is cleared and the open period reset.
        - ``"systemic"``: stay open; the period doubles and its timer restarts.
        - ``"inconclusive"`` (message or permanent failure): the next probe may
          go at once; the period is unchanged.
        """
        if outcome not in _OUTCOMES:
            raise ValueError(f"unknown probe outcome {outcome!r}")
        with self._lock:
            if not self._in_flight:
                raise RuntimeError("probe_result() without a probe in flight")
            self._in_flight = False
            if outcome == "success":
                self._open = False
                self._opened_at = None
                self._probe_at = None
                self._failed_probes = 0
                self._calls.clear()
                self._systemic = 0
            elif outcome == "systemic":
                self._failed_probes += 1
                self._start_period(self._clock())

    def abandon_probe(self) -> None:
        """Forget the probe in flight without a result (its row was released).

        The period is unchanged; another probe may go at once. No-op without a
        probe in flight.
        """
        with self._lock:
            self._in_flight = False

    def forget_window(self) -> None:
        """Start the window afresh (after a global close). No-op while open."""
        with self._lock:
            if not self._open:
                self._calls.clear()
                self._systemic = 0

    def probe_now(self) -> None:
        """Let the next `try_probe` succeed at once (used after a global close).

        No-op when closed or while a probe is in flight.
        """
        with self._lock:
            if self._open and not self._in_flight:
                self._probe_at = self._clock()

    # --- state ----------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        """``"open"`` or ``"closed"``."""
        return "open" if self._open else "closed"

    @property
    def is_open(self) -> bool:
        """True while open (including while a probe is in flight)."""
        return self._open

    @property
    def probe_in_flight(self) -> bool:
        """True between a successful `try_probe` and its result."""
        return self._in_flight

    @property
    def trips(self) -> int:
        """How many times this breaker has tripped since it was created."""
        return self._trips

    @property
    def opened_at(self) -> float | None:
        """Clock value of the last trip while open, else None."""
        return self._opened_at

    @property
    def probe_at(self) -> float | None:
        """Clock value from which the next probe may go while open, else None."""
        return self._probe_at

    def _start_period(self, now: float) -> None:
        period = capped_exponential(self._failed_probes, self._open_for, self._open_for_max)
        self._probe_at = now + period * jitter(self._rng)


# --- global breaker arithmetic ---------------------------------------------------


def _exact(quorum: float) -> Fraction:
    # The quorum as the fraction it was written as: 0.1 is 1/10, so 0.1 × 30
    # is exactly 3 (float gives 3.0000000000000004 and ceil would make it 4).
    return Fraction(quorum).limit_denominator(1_000_000)


def trip_threshold(live: int, quorum: float, min_members: int) -> int:
    """Tripped live members needed to open the group.

    ``max(min_members, ceil(quorum × live))``, with `quorum` read as the
    nearest fraction with a denominator up to 10^6, so float error cannot
    push the ceiling up by one.
    """
    if live < 0:
        raise ValueError(f"live must be >= 0, got {live}")
    if not 0 <= quorum <= 1:
        raise ValueError(f"quorum must be in [0, 1], got {quorum}")
    if min_members < 0:
        raise ValueError(f"min_members must be >= 0, got {min_members}")
    return max(min_members, math.ceil(_exact(quorum) * live))


def group_should_open(tripped: int, live: int, quorum: float, min_members: int) -> bool:
    """True when `tripped` live members reach the group's trip threshold (and at least one)."""
    return tripped > 0 and tripped >= trip_threshold(live, quorum, min_members)


def probe_delay(failures: int, base: float, maximum: float) -> float:
    """Seconds before the next group probe after `failures` systemic probe failures in a row.

    ``min(maximum, base × 2^(failures−1))``; 0 for no failures.
    """
    if failures < 0:
        raise ValueError(f"failures must be >= 0, got {failures}")
    if failures == 0:
        return 0.0
    return capped_exponential(failures - 1, base, maximum)


def pending_scope(
    state: str, epoch: int, reconcile_epoch: int | None, reconcile_from: int | None
) -> tuple[int, int] | None:
    """The breaker epochs `[from, to)` whose systemic failures a reconciliation will refund.

    While the group is OPEN at epoch E, the close will make epoch E + 1 and
    refund failures from the previous close (E - 1) on, plus what an unfinished
    earlier reconciliation still owes; while CLOSED with a reconciliation owed,
    the owed range; otherwise None: nothing is pending and dead systemic rows
    are real dead letters. Mirrors `pgq.sql.breaker.close` and `reconcile_batch`.
    """
    if state == records.BreakerState.OPEN:
        start = epoch - 1
        if reconcile_epoch is not None and reconcile_from is not None:
            start = min(start, reconcile_from)
        return start, epoch + 1
    if reconcile_epoch is not None and reconcile_from is not None:
        return reconcile_from, reconcile_epoch
    return None


# --- the prober's and the heartbeat's decisions (DESIGN §6.2-§6.5) ----------------


class LeadMove(Enum):
    """What an elected prober does next, from the breaker row it just read."""

    RECONCILE = "reconcile"
    """A close still owes refunds: make them (before anything else)."""
    FINISHED = "finished"
    """The group is CLOSED and owes nothing: the prober's work is done."""
    WAIT = "wait"
    """OPEN, but the next probe is not due yet."""
    STOP = "stop"
    """A one-shot (`until_empty`) run ends here: the group stays OPEN (exit 75)."""
    PROBE = "probe"
    """OPEN and a probe is due: run one."""
    SIT_OUT = "sit_out"
    """The prober's turns are used up: it gives the lock up and sits out the next
    election, so another member probes from its own host."""


def lead_move(state: str, reconcile_owed: bool, probe_due: bool, *, one_shot: bool) -> LeadMove:
    """The prober's next move while it holds the lock: reconcile first, finish on
    CLOSED, probe when due, else wait (a one-shot run stops instead of waiting)."""
    if reconcile_owed:
        return LeadMove.RECONCILE
    if state != records.BreakerState.OPEN:
        return LeadMove.FINISHED
    if probe_due:
        return LeadMove.PROBE
    return LeadMove.STOP if one_shot else LeadMove.WAIT


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """What a group probe that did not succeed means for the breaker and the prober."""

    systemic: bool
    """A systemic failure (the outage goes on); else inconclusive (the row's own
    failure, or a snooze): the next probe takes another row."""
    failures: int
    """The group's systemic probe failures in a row, as stored after this one."""
    delay: float
    """Seconds until the next group probe."""
    turns: int
    """This prober's systemic failures in a row under its election."""
    then: LeadMove | None
    """STOP (a one-shot run ends), SIT_OUT (its turns are used up), or None: the
    prober goes on leading."""


def judge_probe(
    systemic: bool,
    failures: int,
    turns: int,
    *,
    interval: float,
    interval_max: float,
    prober_turns: int,
    one_shot: bool,
) -> ProbeVerdict:
    """Judge a group probe that did not succeed (DESIGN §6.4), given the group's
    stored systemic probe `failures` and this prober's `turns` so far.

    Systemic: one more failure, the next probe after `probe_delay` of it, one more
    turn; after `prober_turns` turns the prober sits the next election out.
    Inconclusive: the failures and the interval stay (at least the base interval),
    the turns start again. A one-shot run stops after any probe that did not close.
    """
    if systemic:
        failures, turns = failures + 1, turns + 1
        delay = probe_delay(failures, interval, interval_max)
    else:
        turns = 0
        delay = probe_delay(max(1, failures), interval, interval_max)
    then = None
    if one_shot:
        then = LeadMove.STOP
    elif systemic and turns >= prober_turns:
        then = LeadMove.SIT_OUT
    return ProbeVerdict(systemic, failures, delay, turns, then)


def should_try_open(state: str, local: str, tripped_epoch: int | None, epoch: int) -> bool:
    """Should a heartbeat try to open the group on quorum? Only while the group is
    CLOSED at the epoch this member's local breaker tripped under, and the local
    breaker is still open: a trip from an older epoch (an outage since closed) never
    counts towards a new one."""
    return (
        state == records.BreakerState.CLOSED
        and local == records.LocalBreakerState.OPEN
        and tripped_epoch == epoch
    )


def needs_prober(state: str, reconcile_owed: bool) -> bool:
    """Does a member run a prober? While the group is OPEN, or a close still owes its
    reconciliation (a prober makes it)."""
    return state == records.BreakerState.OPEN or reconcile_owed
