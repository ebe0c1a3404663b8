"""The adaptive prefetch (`prefetch = "adaptive"`): the pool's bound follows the handlers.

Fast handlers want big claims (hundreds of rows per round trip); slow ones want a
small buffer, so idle members of the group can take the rows. The bound is what
the workers finish in `HORIZON` seconds at the pace they have been finishing rows,
between 2 × `workers` and 4 × `batch_size`, and never more than they start within a
quarter of the lease. The fetcher asks before each claim (and at least twice a
second while the pool is full); the clock is injectable.

A rising pace is smoothed; a falling one is taken at once, and the fetcher hands
back unstarted the buffered rows above a lower bound: when handlers slow down,
the rows the member buffered for the fast ones go to the group at once instead
of waiting for its slow workers (the risk of a big buffer is hoarding).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

HORIZON = 0.05
"""Seconds of work the pool holds at the observed pace."""

WINDOW = 0.05
"""Shortest stretch over which the pace is measured."""

SMOOTHING = 0.5
"""Weight of the newest window in a rising pace (an exponential moving average)."""

ROUNDED_FROM, ROUNDED_TO = 64, 16
"""A claim short of a full batch takes, from `ROUNDED_FROM` rows up, a multiple of
`ROUNDED_TO` rows (`claim_limit`); the store rounds smaller ones to a power of two."""


class AdaptivePrefetch:
    """The pool's bound on unstarted rows, from the pace rows are finished."""

    def __init__(
        self, low: int, high: int, lease: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.low, self.high = low, max(low, high)
        self.lease = lease
        self.clock = clock
        self.bound = low
        self.pace: float | None = None
        """Rows finished per second (smoothed); None before the first window."""
        self._at = clock()
        self._finished = 0

    def observe(self, finished: int) -> int | None:
        """`finished`: the member's count of finished rows so far. Returns the new
        bound when it changed, else None."""
        now = self.clock()
        elapsed = now - self._at
        if elapsed < WINDOW:
            return None
        pace = (finished - self._finished) / elapsed
        self._at, self._finished = now, finished
        if self.pace is None or pace < self.pace:
            self.pace = pace
        else:
            self.pace = SMOOTHING * pace + (1 - SMOOTHING) * self.pace
        bound = min(self.high, max(self.low, math.ceil(self.pace * HORIZON)))
        bound = min(bound, max(self.low, math.floor(self.pace * self.lease / 4)))
        if bound == self.bound:
            return None
        self.bound = bound
        return bound


def claim_want(batch_size: int, capacity: int) -> int:
    """Free slots the fetcher waits for before it claims: half a batch (or half the
    pool when that is smaller), so a claim is never a trickle of single rows."""
    return max(1, min(batch_size, capacity) // 2)


def claim_limit(
    *, batch_size: int, free: int, ramped: int, budget: int | None, room: int
) -> tuple[int, bool]:
    """How many rows the next claim may take, and whether the acker holds it back.

    At most a batch, the pool's `free` slots, the `ramped` slots the ramp after a
    group close allows, what is left of `max_messages` (`budget`, None: no limit)
    and the `room` the acker has for outcomes. Held back (the second value) when
    the acker's room is what stops the claim: outcomes are not written as fast as
    rows finish, and the fetcher waits a little rather than spin.

    A claim short of a full batch is rounded down (from `ROUNDED_FROM` rows, to a
    multiple of `ROUNDED_TO`): each distinct limit is a claim statement of its own,
    compiled (~4 ms of CPU) and planned by the server until it is prepared, and a
    run of the adaptive prefetch asked for a dozen sizes between 64 and 100.
    """
    limit = min(batch_size, free, ramped, free if budget is None else budget)
    held_back = room < limit
    if held_back:
        limit = room
    if ROUNDED_FROM <= limit < batch_size:
        limit -= limit % ROUNDED_TO
    return limit, held_back and limit <= 0
