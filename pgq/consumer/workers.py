"""Worker threads: run the handler on rows from the pool and report outcomes.

Workers never touch the database. Each row passes the gate first (a closed
gate turns it away: it is deferred for release, unstarted); each outcome goes
to the gate (the local breaker counts it) and then to the acker. A handler
that runs past `handler_timeout` is abandoned by the watchdog: its row gets a
systemic `TimeoutError` outcome at once, a new worker takes the thread's
place, and whatever the old thread returns later is discarded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sqlalchemy import Connection

from pgq.consumer.acker import Acker
from pgq.consumer.gate import Gate
from pgq.consumer.member import Member, Role
from pgq.consumer.timing import HANDLER
from pgq.consumer.transactions import Ended, Transactions
from pgq.errors import PgqError
from pgq.logcontext import get_logger
from pgq.records import Claimed, Outcome, OutcomeKind
from pgq.store import RoleConnection

logger = get_logger("pgq.consumer")

Clock = Callable[[], float]

DONE = OutcomeKind.DONE

IDLE_WAIT = 5.0
"""Seconds an idle worker sleeps between checks (few wake-ups when idle)."""


class Worker(Role):
    """Takes rows from the pool and runs the handler on each."""

    def __init__(self, member: Member, index: int, gate: Gate, acker: Acker, clock: Clock) -> None:
        super().__init__(member, f"pgq-worker-{index}")
        self.gate = gate
        self.acker = acker
        self.clock = clock
        self.retired = threading.Event()
        self._lock = threading.Lock()
        self.current: tuple[Claimed, float] | None = None
        """The row whose handler runs now and when it started (a tuple: one per
        message). Only the watchdog clears it while the handler runs: when it
        abandons the attempt."""
        self.handler_time = member.histogram(HANDLER)
        """This worker's handler durations, while metrics are served (else None)."""

    def work(self) -> None:
        m = self.member
        while not self.retired.is_set():
            row = m.pool.take(timeout=IDLE_WAIT)  # closing the pool wakes every worker
            if row is None:
                if m.pool.closed or (m.stop_claiming.is_set() and len(m.pool) == 0):
                    return
                continue
            if self.gate.admit(row):
                self.execute(row)
            else:
                m.defer(row)
                self.gate.nudge()  # the fetcher releases it

    def execute(self, row: Claimed) -> None:
        """Run the handler on one row and report its outcome (unless abandoned)."""
        started = self.clock()
        with self._lock:
            self.current = (row, started)
        transactions = self.member.transactions
        if transactions is not None:
            self._execute_in_transaction(row, started, transactions)
            return
        outcome = self.member.handling.run(row)
        if self._claim_attempt(row):
            self._finished(started)
            report(self.member, self.gate, self.acker, outcome)

    def _claim_attempt(self, row: Claimed) -> bool:
        """Take the running attempt back from the watchdog: False (and logged) when it
        was abandoned meanwhile (timed out: its outcome is already reported)."""
        with self._lock:
            abandoned, self.current = self.current is None, None
        if abandoned:  # the watchdog timed it (once): the attempt it finished
            logger.warning("late outcome discarded id=%d (handler timed out)", row.id)
        return not abandoned

    def _finished(self, started: float) -> None:
        if self.handler_time is not None:
            self.handler_time.observe(self.clock() - started)

    def _execute_in_transaction(
        self, row: Claimed, started: float, transactions: Transactions
    ) -> None:
        """A transactional handler: its success commits with the handler's writes
        here; a failure goes to the acker as any handler's."""
        m = self.member
        done = Outcome(row, DONE)

        def write(conn: Connection) -> bool:
            return row.lease in m.store.record(conn, [done])

        attempt = transactions.run(row, write, lambda: self._claim_attempt(row))
        if attempt.ended == Ended.ABANDONED:
            return
        if attempt.ended == Ended.UNSTARTED:
            if self._claim_attempt(row):
                m.defer(row)  # back to ready, uncharged: the fetcher releases it
                self.gate.nudge()
            return
        if attempt.ended == Ended.FAILED:
            if self._claim_attempt(row):
                self._finished(started)
                report(m, self.gate, self.acker, attempt.outcome)
            return
        self._finished(started)
        written = attempt.ended == Ended.COMMITTED
        if attempt.ended == Ended.UNKNOWN:
            written = self._settled(done)
        self.gate.observe(done)
        m.count_outcome(done, pending=False)
        m.let_go([row.lease])
        if not written:
            logger.warning("outcome refused id=%d reason=lease lost (rolled back)", row.id)
            m.count_refused(done)

    def _settled(self, done: Outcome) -> bool:
        """Whether a commit whose answer was lost happened: the row tells (gone or
        done under this lease). Unknown for good (the database stays away): not
        counted done; the lease then expires and the message runs again if the
        commit did not happen."""
        m = self.member
        conn = RoleConnection(m.links.work, "worker", m.halt)
        try:
            return done.claimed.lease in conn.retrying(m.store.settled, [done])
        except PgqError as exc:
            logger.warning("commit of id=%d unknown error=%s", done.claimed.id, exc)
            return False

    def abandon_if_overdue(self, now: float, timeout: float) -> tuple[Outcome, float] | None:
        """If the running handler is past `timeout`, abandon it; return its outcome and
        how long it had run."""
        with self._lock:
            current = self.current
            if current is None or now - current[1] < timeout:
                return None
            self.current = None
        row, started = current
        self.retired.set()
        exc = TimeoutError(f"handler ran longer than handler_timeout ({timeout:g}s)")
        logger.warning("handler timed out id=%d thread=%s", row.id, self.name)
        return self.member.handling.failure(row, exc), now - started


def report(member: Member, gate: Gate, acker: Acker, outcome: Outcome) -> None:
    """A finished attempt: the local breaker sees it, the run counts it, the acker writes it."""
    gate.observe(outcome)
    member.count_outcome(outcome)
    acker.submit(outcome)


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
        self.timed_out = member.histogram(HANDLER)
        """The handler runs the watchdog abandoned, timed when abandoned (it alone
        writes them; their worker records nothing); None when nothing is timed."""

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
        """Abandon handlers past `handler_timeout` and replace their threads."""
        now, limit = self.clock(), self.member.settings.handler_timeout
        for worker in list(self.threads):
            abandoned = worker.abandon_if_overdue(now, limit)
            if abandoned is not None:
                outcome, took = abandoned
                self.threads.remove(worker)
                if self.timed_out is not None:
                    self.timed_out.observe(took)
                report(self.member, self.gate, self.acker, outcome)
                if not self.member.stop_claiming.is_set():
                    self.spawn()

    def join(self, deadline: float) -> list[Worker]:
        """Wait for the workers until `deadline` (monotonic); return those still running."""
        for worker in self.threads:
            worker.join(max(0.0, deadline - time.monotonic()))
        return [w for w in self.threads if w.is_alive()]
