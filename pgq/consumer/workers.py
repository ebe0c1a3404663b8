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
from pgq.consumer.transactions import Ended, Transactions, commit_settled
from pgq.logcontext import get_logger
from pgq.otel import tracing as otel
from pgq.otel.tracing import ConsumerTracing, Result
from pgq.records import Claimed, Lease, Outcome, OutcomeKind
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
        self.current: tuple[Claimed | list[Claimed], float] | None = None
        """The row whose handler runs now and when it started (a tuple: one per
        message). Only the watchdog clears it while the handler runs: when it
        abandons the attempt."""
        self.handler_time = member.histogram(HANDLER)
        """This worker's handler durations, while metrics are served (else None)."""

    def work(self) -> None:
        m = self.member
        batching = m.transactions is not None and m.transactions.batch
        batch_size = m.settings.batch_size
        tracing = m.tracing  # set at start: nothing per message when None
        while not self.retired.is_set():
            row = m.pool.take(timeout=IDLE_WAIT)  # closing the pool wakes every worker
            if row is None:
                if m.pool.closed or (m.stop_claiming.is_set() and len(m.pool) == 0):
                    return
                continue
            if batching:
                rows = [row, *m.pool.take_more(batch_size - 1)]
                admitted = [r for r in rows if self._admit(r)]
                if not admitted:
                    continue
                if tracing is None:
                    self.execute_batch(admitted)
                else:
                    self.traced(tracing, admitted, batch=True)
            elif self._admit(row):
                if tracing is None:
                    self.execute(row)
                else:
                    self.traced(tracing, [row], batch=False)

    def _admit(self, row: Claimed) -> bool:
        """The gate lets `row` run and its lease has not lapsed; else it is deferred,
        unstarted, for release (fenced: a lease taken over meanwhile is left alone)."""
        if self.member.lease_lapsed(row, time.monotonic()):
            logger.info("lease may have lapsed id=%d: handed back unstarted", row.id)
        elif self.gate.admit(row):
            return True
        self.member.defer(row)
        self.gate.nudge()  # the fetcher releases it
        return False

    def traced(self, tracing: ConsumerTracing, rows: list[Claimed], *, batch: bool) -> None:
        """`execute` (one row) or `execute_batch` in a CONSUMER span (`pgq.otel`)."""
        with tracing.processing(rows) as span:
            span.finished(self.execute_batch(rows) if batch else self.execute(rows[0]))

    def execute(self, row: Claimed) -> Result:
        """Run the handler on one row and report its outcome (unless abandoned: then
        None); what it ended in."""
        started = self.clock()
        with self._lock:
            self.current = (row, started)
        transactions = self.member.transactions
        if transactions is not None:
            return self._in_transaction([row], started, transactions)
        outcome = self.member.handling.run(row)
        if self._claim_attempt(row):
            self._finished(started)
            report(self.member, self.gate, self.acker, outcome)
            return outcome
        return None

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

    def execute_batch(self, rows: list[Claimed]) -> Result:
        """A transactional batch handler on admitted `rows`: one transaction."""
        transactions = self.member.transactions
        assert transactions is not None
        started = self.clock()
        with self._lock:
            self.current = (rows, started)
        return self._in_transaction(rows, started, transactions)

    def _in_transaction(
        self, rows: list[Claimed], started: float, transactions: Transactions
    ) -> list[tuple[Outcome, str]] | None:
        """A transactional handler on `rows`: successes commit with the handler's
        writes here; failures go to the acker as any handler's; rows rolled back
        without a failure of their own go back to ready uncharged. Returns what
        became of each row, in words (`pgq.otel`): None when abandoned."""
        m = self.member
        done = [Outcome(row, DONE) for row in rows]

        def write(conn: Connection) -> set[Lease]:
            return m.store.record(conn, done)

        def proceed() -> bool:
            return self._claim_attempt(rows[0])

        if transactions.batch:
            attempts = transactions.run_batch(rows, write, proceed)
        else:
            attempts = [transactions.run(rows[0], lambda conn: bool(write(conn)), proceed)]
        if attempts[0].ended == Ended.ABANDONED:
            return None
        self._finished(started)
        unknown = [a.outcome for a in attempts if a.ended == Ended.UNKNOWN]
        settled = set()
        if unknown:
            conn = RoleConnection(m.links.work, "worker", m.halt)
            settled = commit_settled(conn, m.store, unknown, attempts[0].backend, m.halt)
        released = False
        results: list[tuple[Outcome, str]] = []
        for attempt in attempts:
            outcome, ended = attempt.outcome, attempt.ended
            if ended == Ended.RELEASED:
                m.defer(outcome.claimed)  # back to ready, uncharged: the fetcher releases it
                released = True
                results.append((outcome, otel.RELEASED))
            elif ended == Ended.FAILED:
                report(m, self.gate, self.acker, outcome)
                results.append((outcome, str(outcome.kind)))
            else:
                written = ended == Ended.COMMITTED or outcome.claimed.lease in settled
                self._committed(outcome, written)
                results.append((outcome, str(outcome.kind) if written else otel.REFUSED))
        if released:
            self.gate.nudge()
        return results

    def _committed(self, done: Outcome, written: bool) -> None:
        """A success this worker wrote itself, with the handler's writes (or refused)."""
        m = self.member
        self.gate.observe(done)
        m.count_outcome(done, pending=False)
        m.let_go([done.claimed.lease])
        if not written:
            logger.warning("outcome refused id=%d reason=lease lost (rolled back)", done.claimed.id)
            m.count_refused(done)

    def abandon_if_overdue(self, now: float, timeout: float) -> tuple[list[Outcome], float] | None:
        """If the running handler is past `timeout`, abandon it; return its outcomes
        (one per row: a batch handler runs several) and how long it had run."""
        with self._lock:
            current = self.current
            if current is None or now - current[1] < timeout:
                return None
            self.current = None
        running, started = current
        rows = running if isinstance(running, list) else [running]
        self.retired.set()
        exc = TimeoutError(f"handler ran longer than handler_timeout ({timeout:g}s)")
        logger.warning("handler timed out ids=%s thread=%s", [r.id for r in rows], self.name)
        took = now - started
        return [self.member.handling.failure(row, exc)._replace(seconds=took) for row in rows], took


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
                outcomes, took = abandoned
                self.threads.remove(worker)
                if self.timed_out is not None:
                    self.timed_out.observe(took)
                for outcome in outcomes:
                    report(self.member, self.gate, self.acker, outcome)
                if not self.member.stop_claiming.is_set():
                    self.spawn()

    def join(self, deadline: float) -> list[Worker]:
        """Wait for the workers until `deadline` (monotonic); return those still running."""
        for worker in self.threads:
            worker.join(max(0.0, deadline - time.monotonic()))
        return [w for w in self.threads if w.is_alive()]
