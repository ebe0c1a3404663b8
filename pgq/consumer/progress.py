"""The member's progress line: once a minute, that it is alive and how fast it goes.

    progress group=billing member=host:12:ab12 handled=5820 rate=97.0/s lag=130
             breaker=CLOSED local_breaker=closed

`handled`: attempts the member finished since the line before; `rate`: those per
second; `lag`: the group's messages not yet resolved (ready + leased, as `pgq
status` says; one count through the partial indexes, on the maintenance thread's
connection; null when the database did not answer); `breaker` and
`local_breaker`: the group's breaker as the member last saw it, and its own. A
task of the maintenance thread (`Runtime`), the first one interval after the
start; `PROGRESS_EVERY` is read when a member starts.
"""

from __future__ import annotations

from collections.abc import Callable

from pgq.consumer.gate import Gate
from pgq.consumer.member import Member
from pgq.errors import DatabaseUnavailable, TransactionConflict
from pgq.logcontext import get_logger
from pgq.store import RoleConnection

logger = get_logger("pgq.consumer")

PROGRESS_EVERY = 60.0
"""Seconds between a member's progress lines."""


def rate(handled: int, seconds: float) -> float:
    """`handled` per second over `seconds`, to one decimal (0 over no time)."""
    return round(handled / seconds, 1) if seconds > 0 else 0.0


class Progress:
    """Logs the progress line each time it is called (a maintenance task)."""

    def __init__(
        self, member: Member, gate: Gate, conn: RoleConnection, clock: Callable[[], float]
    ) -> None:
        self.member = member
        self.gate = gate
        self.conn = conn
        self.clock = clock
        self._since = clock()
        self._handled = 0

    def __call__(self) -> None:
        m = self.member
        with m.lock:
            total = m.tally.handled
        now = self.clock()
        handled, seconds = total - self._handled, now - self._since
        self._since, self._handled = now, total
        lag: int | None
        try:
            lag = self.conn.run(m.store.lag)
        except (DatabaseUnavailable, TransactionConflict):
            lag = None  # the line still says the member is alive
        local, _ = self.gate.local_report()
        logger.info(
            "progress handled=%d rate=%.1f/s lag=%s breaker=%s local_breaker=%s",
            handled,
            rate(handled, seconds),
            lag,
            self.gate.group_state,
            local,
        )
