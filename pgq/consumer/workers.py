"""Worker threads: run the handler on rows from the pool and report outcomes.

Workers never touch the database. Each row passes the gate first (a closed
gate turns it away: it is deferred for release, unstarted); each outcome goes
to the gate at once (the local breaker counts it) and then, with the worker's
others, to the run's tally and the acker. A handler that runs past
`handler_timeout` is abandoned by the watchdog: its row gets a systemic
`TimeoutError` outcome at once, a new worker takes the thread's place, and
whatever the old thread returns later is discarded.

Hand-offs come in batches while handlers are fast (decision 0028): a worker
takes as many rows as its handlers get through in about `CHUNK_BUDGET`
(`Pace`), and reports its outcomes together once `REPORT_AFTER` has passed,
`REPORT_AT` have piled up, or it has nothing more to start. Slow handlers (or a
row that turns out slow) go back to one row and one report at a time: rows a
worker took but did not start go back to the pool for the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pgq.consumer.acker import Acker
from pgq.consumer.gate import Gate
from pgq.consumer.member import Member, Role
from pgq.records import Claimed, Outcome

logger = logging.getLogger("pgq.consumer")

Clock = Callable[[], float]

IDLE_WAIT = 5.0
"""Seconds an idle worker sleeps between checks (few wake-ups when idle)."""

CHUNK_BUDGET = 0.002
"""Seconds of handler time a worker takes rows for at once."""

MAX_CHUNK = 16
"""Most rows a worker takes at once."""

SLOW = 0.005
"""A handler slower than this hands the rows its worker took but did not start
back to the pool, and is reported at once."""

REPORT_AFTER = 0.002
"""Longest a finished outcome waits in its worker for the next ones."""

REPORT_AT = 32
"""Outcomes a worker reports together at most."""


class Pace:
    """How long a worker's handlers take (an exponentially weighted mean), and so how
    many rows it takes at once: pure, fed by the worker's own clock readings."""

    WEIGHT = 0.2

    def __init__(self) -> None:
        self.mean = SLOW  # one row at a time until handlers prove fast

    def ran(self, seconds: float) -> None:
        self.mean += self.WEIGHT * (max(0.0, seconds) - self.mean)

    def fast(self) -> bool:
        """Handlers this fast share hand-offs: several rows taken, outcomes reported
        together."""
        return self.mean < CHUNK_BUDGET / 2

    def chunk(self) -> int:
        """Rows to take at once: about `CHUNK_BUDGET` of work, 1 to `MAX_CHUNK`."""
        if not self.fast():
            return 1
        return min(MAX_CHUNK, max(1, int(CHUNK_BUDGET / max(self.mean, 1e-6))))


@dataclass(slots=True, eq=False)
class Attempt:
    """One handler run in progress."""

    row: Claimed
    started: float
    """By the worker's (injectable) clock: what `handler_timeout` is measured on."""
    began: float
    """By `time.monotonic`: what the pace and the hand-backs are measured on."""
    abandoned: bool = False


class Worker(Role):
    """Takes rows from the pool and runs the handler on each."""

    def __init__(self, member: Member, index: int, gate: Gate, acker: Acker, clock: Clock) -> None:
        super().__init__(member, f"pgq-worker-{index}")
        self.gate = gate
        self.acker = acker
        self.clock = clock
        self.retired = threading.Event()
        self._lock = threading.Lock()
        self.current: Attempt | None = None
        self.pace = Pace()
        self._finished: list[Outcome] = []
        """Outcomes not yet reported (guarded by `_lock`: the watchdog takes them
        when it abandons this worker)."""
        self._oldest = 0.0
        """When the first of `_finished` came (`time.monotonic`)."""
        self._waiting: list[Claimed] = []
        """Rows this worker took and has not started (guarded by `_lock`: the
        watchdog hands them back to the pool while a handler runs long)."""

    def work(self) -> None:
        m = self.member
        try:
            while not self.retired.is_set():
                # with outcomes to report, look without waiting: report before sleeping
                rows = m.pool.take_many(self.pace.chunk(), 0 if self._finished else IDLE_WAIT)
                if not rows:
                    if self._finished:
                        self.report_finished()
                    elif m.pool.closed or (m.stop_claiming.is_set() and len(m.pool) == 0):
                        return  # closing the pool wakes every worker
                    continue
                self.run_rows(rows)
        finally:
            self.report_finished()

    def run_rows(self, rows: list[Claimed]) -> None:
        """Start the rows in order; hand back those a slow one (or a retirement) kept."""
        m = self.member
        with self._lock:
            self._waiting = rows[1:]
        row: Claimed | None = rows[0]
        while row is not None:
            if self.retired.is_set() or m.pool.closed:  # the member stops: start no more
                self.hand_back()
                m.pool.give_back([row])  # a shut pool keeps them for the release
                return
            if self.gate.admit(row):
                if self.execute(row):
                    self.hand_back()  # slow handlers: one row at a time again
            else:
                m.defer(row)
                self.gate.nudge()  # the fetcher releases it
            with self._lock:
                row = self._waiting.pop(0) if self._waiting else None

    def hand_back(self, running_for: float | None = None) -> None:
        """Give the rows this worker took and has not started back to the pool (with
        `running_for`: only while its handler has run that long; the watchdog's
        call, so that one slow row does not hold the rows taken with it)."""
        with self._lock:
            attempt = self.current
            if running_for is not None and (
                attempt is None or time.monotonic() - attempt.began < running_for
            ):
                return
            rows, self._waiting = self._waiting, []
        self.member.pool.give_back(rows)

    def execute(self, row: Claimed) -> bool:
        """Run the handler on one row and keep its outcome for the next report
        (unless abandoned); True when the handler was slow (reported at once)."""
        began = time.monotonic()
        attempt = Attempt(row, self.clock(), began)
        with self._lock:
            self.current = attempt
        outcome = self.member.handling.run(row)
        ended = time.monotonic()
        self.pace.ran(ended - began)
        with self._lock:
            self.current = None
            if attempt.abandoned:
                logger.warning("late outcome discarded id=%d (handler timed out)", row.id)
                return True
            if not self._finished:
                self._oldest = ended
            self._finished.append(outcome)
            due = (
                len(self._finished) >= REPORT_AT
                or ended - self._oldest >= REPORT_AFTER
                or ended - began >= SLOW
                or not self.pace.fast()
            )
        self.gate.observe(outcome)
        if due:
            self.report_finished()
        return ended - began >= SLOW

    def report_finished(self, older_than: float | None = None) -> None:
        """Report the outcomes kept so far (with `older_than`: only if the first of
        them came that many seconds ago; the watchdog's call, for a worker whose
        next handler turned out slow)."""
        with self._lock:
            if older_than is not None and (
                not self._finished or time.monotonic() - self._oldest < older_than
            ):
                return
            outcomes, self._finished = self._finished, []
        if outcomes:
            report(self.member, self.acker, outcomes)

    def abandon_if_overdue(self, now: float, timeout: float) -> list[Outcome]:
        """If the running handler is past `timeout`, abandon it: its outcome, after
        the ones this worker kept (empty when it is not overdue)."""
        with self._lock:
            attempt = self.current
            if attempt is None or now - attempt.started < timeout:
                return []
            attempt.abandoned = True
            self.current = None
            kept, self._finished = self._finished, []
            waiting, self._waiting = self._waiting, []
        self.retired.set()
        self.member.pool.give_back(waiting)
        exc = TimeoutError(f"handler ran longer than handler_timeout ({timeout:g}s)")
        logger.warning("handler timed out id=%d thread=%s", attempt.row.id, self.name)
        outcome = self.member.handling.failure(attempt.row, exc)
        self.gate.observe(outcome)
        return [*kept, outcome]


def report(member: Member, acker: Acker, outcomes: list[Outcome]) -> None:
    """Finished attempts the gate has seen: the run counts them, the acker writes them."""
    member.count_outcomes(outcomes)
    acker.submit(outcomes)


class Workers:
    """The member's worker threads, and the handler-timeout watchdog."""

    def __init__(
        self, member: Member, gate: Gate, acker: Acker, clock: Clock = time.monotonic
    ) -> None:
        self.member = member
        self.gate = gate
        self.acker = acker
        self.clock = clock
        self.threads: list[Worker] = []
        self._spawned = 0

    def spawn(self) -> Worker:
        self._spawned += 1
        worker = Worker(self.member, self._spawned, self.gate, self.acker, self.clock)
        self.threads.append(worker)
        worker.start()
        return worker

    def start(self) -> None:
        for _ in range(self.member.settings.workers):
            self.spawn()

    def check_timeouts(self) -> None:
        """Abandon handlers past `handler_timeout` and replace their threads; report
        what a worker kept while its next handler runs long."""
        now, limit = self.clock(), self.member.settings.handler_timeout
        for worker in list(self.threads):
            worker.report_finished(older_than=REPORT_AFTER)
            worker.hand_back(running_for=SLOW)
            outcomes = worker.abandon_if_overdue(now, limit)
            if outcomes:
                self.threads.remove(worker)
                report(self.member, self.acker, outcomes)
                if not self.member.stop_claiming.is_set():
                    self.spawn()

    def join(self, deadline: float) -> list[Worker]:
        """Wait for the workers until `deadline` (monotonic); return those still running."""
        for worker in self.threads:
            worker.join(max(0.0, deadline - time.monotonic()))
        return [w for w in self.threads if w.is_alive()]
