"""The member's progress line: once a minute, that it is alive and how fast it goes.

    progress group=billing member=host:12:ab12 handled=5820 rate=97.0/s lag=130
             breaker=CLOSED local_breaker=closed

`handled`: attempts the member finished since the line before; `rate`: those per
second; `lag`: the group's messages not yet resolved (ready + leased, as `pgq
status` says; one count through the partial indexes, read by the maintenance
thread on its connection at the start and every half interval; null when no
read came back within the last interval: the database did not answer); `breaker` and
`local_breaker`: the group's breaker as the member last saw it, and its own.

The line comes from a thread of its own (`pgq-progress`), the first one interval
after the start, and never waits for the database: while the route to it stalls
(a statement then hangs as long as TCP keeps the socket), the line still says
that the member is alive, with `lag` null (decision 0032). `PROGRESS_EVERY` is
read when a member starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pgq.consumer.gate import Gate
from pgq.consumer.member import Member, Role
from pgq.errors import DatabaseUnavailable, TransactionConflict
from pgq.logcontext import get_logger
from pgq.store import RoleConnection

logger = get_logger("pgq.consumer")

PROGRESS_EVERY = 60.0
"""Seconds between a member's progress lines."""


def rate(handled: int, seconds: float) -> float:
    """`handled` per second over `seconds`, to one decimal (0 over no time)."""
    return round(handled / seconds, 1) if seconds > 0 else 0.0


class Progress(Role):
    """Logs the progress line every `every` seconds until `stop()`; the lag is the
    latest the maintenance thread read (`read_lag`, a maintenance task)."""

    def __init__(
        self,
        member: Member,
        gate: Gate,
        clock: Callable[[], float],
        every: float | None = None,
    ) -> None:
        super().__init__(member, "pgq-progress")
        self.gate = gate
        self.clock = clock
        self.every = PROGRESS_EVERY if every is None else every
        self.finish = threading.Event()
        self._lock = threading.Lock()
        self._lag: tuple[int, float] | None = None
        """The latest lag read, and when (`clock`)."""
        self._since = clock()
        self._handled = 0

    def read_lag(self, conn: RoleConnection) -> None:
        """Read the group's lag on `conn` and keep it for the next line (a database
        that does not answer leaves the last one to age)."""
        try:
            lag = conn.run(self.member.store.lag)
        except (DatabaseUnavailable, TransactionConflict):
            return  # the line says null once the last read is too old
        with self._lock:
            self._lag = (lag, self.clock())

    def lag(self) -> int | None:
        """The latest lag read, None when it is older than one interval (or none came)."""
        with self._lock:
            latest = self._lag
        if latest is None or self.clock() - latest[1] > self.every:
            return None
        return latest[0]

    def work(self) -> None:
        while not self.finish.wait(self.every):
            try:
                self.line()
            except Exception:  # a line that fails must not stop the member
                logger.exception("progress line failed")

    def stop(self) -> None:
        self.finish.set()

    def line(self) -> None:
        """Log the progress line (reads memory only)."""
        m = self.member
        with m.lock:
            total = m.tally.handled
        now = self.clock()
        handled, seconds = total - self._handled, now - self._since
        self._since, self._handled = now, total
        local, _ = self.gate.local_report()
        logger.info(
            "progress handled=%d rate=%.1f/s lag=%s breaker=%s local_breaker=%s",
            handled,
            rate(handled, seconds),
            self.lag(),
            self.gate.group_state,
            local,
        )
