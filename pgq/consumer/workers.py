"""Worker threads: run the handler on rows from the pool and report outcomes.

Workers never touch the database. A handler that runs past `handler_timeout`
is abandoned: its row gets a systemic `TimeoutError` outcome at once, a new
worker takes the thread's place, and whatever the old thread returns later is
discarded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pgq.backoff import retry_delay
from pgq.consumer.member import Member, Role
from pgq.consumer.model import Claimed, Outcome
from pgq.errors import RetryLater

logger = logging.getLogger("pgq.consumer")

Clock = Callable[[], float]

IDLE_WAIT = 5.0
"""Seconds an idle worker sleeps between checks (few wake-ups when idle)."""


@dataclass(slots=True, eq=False)
class Attempt:
    """One handler run in progress."""

    row: Claimed
    started: float
    abandoned: bool = False


def failure_outcome(member: Member, row: Claimed, exc: BaseException) -> Outcome:
    """The outcome of a handler that raised `exc`: retry, or dead."""
    if isinstance(exc, RetryLater):
        return Outcome(row, "snooze", delay=exc.delay)
    error_class = member.classify(exc)
    text = f"{type(exc).__name__}: {exc}"
    finished = row.attempts + 1
    s = member.settings
    if error_class == "permanent" or finished >= s.max_attempts:
        return Outcome(row, "dead", error_class=error_class, error=text)
    delay = retry_delay(finished, s.retry_backoff, s.retry_backoff_max)
    return Outcome(row, "retry", delay=delay, error_class=error_class, error=text)


class Worker(Role):
    """Takes rows from the pool and runs the handler on each."""

    def __init__(
        self,
        member: Member,
        index: int,
        report: Callable[[Outcome], None],
        admit: Callable[[Claimed], bool],
        clock: Clock,
    ) -> None:
        super().__init__(member, f"pgq-worker-{index}")
        self.report = report
        self.admit = admit
        self.clock = clock
        self.retired = threading.Event()
        self._lock = threading.Lock()
        self.current: Attempt | None = None

    def work(self) -> None:
        m = self.member
        while not self.retired.is_set():
            row = m.pool.take(timeout=IDLE_WAIT)  # closing the pool wakes every worker
            if row is None:
                if m.stop_claiming.is_set() and len(m.pool) == 0:
                    return
                continue
            if self.admit(row):
                self.execute(row)

    def execute(self, row: Claimed) -> None:
        """Run the handler on one row and report its outcome (unless abandoned)."""
        attempt = Attempt(row, self.clock())
        with self._lock:
            self.current = attempt
        try:
            self.member.handler(row.message)
            outcome = Outcome(row, "done")
        except BaseException as exc:  # a handler's SystemExit must not kill the worker
            outcome = failure_outcome(self.member, row, exc)
            logger.debug("handler failed id=%d outcome=%s error=%r", row.id, outcome.kind, exc)
        with self._lock:
            self.current = None
            if attempt.abandoned:
                logger.warning("late outcome discarded id=%d (handler timed out)", row.id)
                return
        self.report(outcome)

    def abandon_if_overdue(self, now: float, timeout: float) -> Outcome | None:
        """If the running handler is past `timeout`, abandon it; return its outcome."""
        with self._lock:
            attempt = self.current
            if attempt is None or now - attempt.started < timeout:
                return None
            attempt.abandoned = True
            self.current = None
        self.retired.set()
        exc = TimeoutError(f"handler ran longer than handler_timeout ({timeout:g}s)")
        logger.warning("handler timed out id=%d thread=%s", attempt.row.id, self.name)
        return failure_outcome(self.member, attempt.row, exc)


class Workers:
    """The member's worker threads, and the handler-timeout watchdog."""

    def __init__(
        self,
        member: Member,
        report: Callable[[Outcome], None],
        admit: Callable[[Claimed], bool],
        clock: Clock = time.monotonic,
    ) -> None:
        self.member = member
        self.report = report
        self.admit = admit
        self.clock = clock
        self.threads: list[Worker] = []
        self._spawned = 0

    def spawn(self) -> Worker:
        self._spawned += 1
        worker = Worker(self.member, self._spawned, self.report, self.admit, self.clock)
        self.threads.append(worker)
        worker.start()
        return worker

    def start(self) -> None:
        for _ in range(self.member.settings.workers):
            self.spawn()

    def check_timeouts(self) -> None:
        """Abandon handlers past `handler_timeout` and replace their threads."""
        now, limit = self.clock(), self.member.settings.handler_timeout
        for worker in list(self.threads):
            outcome = worker.abandon_if_overdue(now, limit)
            if outcome is not None:
                self.threads.remove(worker)
                self.report(outcome)
                if not self.member.stop_claiming.is_set():
                    self.spawn()

    def join(self, deadline: float) -> list[Worker]:
        """Wait for the workers until `deadline` (monotonic); return those still running."""
        for worker in self.threads:
            worker.join(max(0.0, deadline - time.monotonic()))
        return [w for w in self.threads if w.is_alive()]

    def running(self) -> list[Claimed]:
        """Rows whose handler is running now."""
        rows = []
        for worker in self.threads:
            attempt = worker.current
            if attempt is not None:
                rows.append(attempt.row)
        return rows
