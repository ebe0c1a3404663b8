"""The prober thread: elected by an advisory lock while the group breaker is OPEN.

Every member runs one while the group is OPEN (or a reconciliation is owed).
It tries a session-level `pg_try_advisory_lock` on a dedicated connection
outside any pool; the holder is the prober. The prober probes with a real
message, closes the group on success (a conditional update on the epoch it
saw: the lock only elects, it does not make writes safe), and reconciles
(refunds the outage's systemic rows) in bounded batches. It checks its lock
connection before every step and steps down at once on any error. If it dies,
its connection drops, the lock frees itself and another member takes over.

If it stops answering instead (SIGSTOP, a hung host), its connection lingers:
so the server ends the lock's session once it has been idle for
`breaker.member_ttl` (`idle_session_timeout`), and a live prober keeps that
session busy more often than that, also while its probe's handler runs and
while it waits for the next probe time. A prober that resumes after its
session was ended finds the lock lost and steps down; its close, conditional on
the epoch it saw, can no longer close a newer outage.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection

from pgq.breaker import LeadMove, ProbeVerdict, judge_probe, lead_move
from pgq.consumer.acker import write_outcomes
from pgq.consumer.gate import Gate
from pgq.consumer.member import Member, Role
from pgq.consumer.timing import HANDLER
from pgq.consumer.transactions import Ended, commit_settled
from pgq.errors import DatabaseUnavailable, PgqError
from pgq.logcontext import carrying, get_logger
from pgq.otel import tracing as otel
from pgq.records import (
    BreakerState,
    BreakerView,
    Claimed,
    ErrorClass,
    Lease,
    Outcome,
    OutcomeKind,
)
from pgq.store import LostLock, RoleConnection, probe_lock

T = TypeVar("T")

logger = get_logger("pgq.breaker")

RECONCILE_BATCH = 5000

RENEW_SHARE = 1 / 3
"""A probe in flight renews its slot (reserved for `breaker.member_ttl`) every this
share of it, so a prober that dies or stops answering frees the slot within the ttl."""

PROBE_THREAD = "pgq-probe-attempt"
"""The name of the thread a group probe's handler runs in (handlers may log it)."""


class Prober(Role):
    """Runs elections, probes, the close and the reconciliation for one member."""

    def __init__(
        self,
        member: Member,
        gate: Gate,
        *,
        one_shot: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(member, "pgq-prober")
        self.gate = gate
        self.one_shot = one_shot
        self.clock = clock
        self.done = threading.Event()
        self.conn = RoleConnection(member.links.claims, "prober", member.stopping)
        self.lock = probe_lock(
            member.links.session,
            member.store.group,
            idle_timeout=member.settings.breaker_member_ttl,
        )
        self.sitting_out = False
        self.probe_time = member.histogram(HANDLER)
        """The probes' handler runs, while metrics are served (else None)."""

    # -- election ---------------------------------------------------------------

    def work(self) -> None:
        m = self.member
        try:
            while not m.stopping.is_set():
                view = self.conn.retrying(m.store.breaker)
                self.gate.see_group(view.state, view.epoch)
                if view.state == BreakerState.CLOSED and view.reconcile_epoch is None:
                    return
                if self.sitting_out:
                    self.sitting_out = False
                    self._pause(m.settings.breaker_probe_interval)
                    continue
                try:
                    won = self.lock.acquire()
                except DatabaseUnavailable as exc:
                    logger.warning("probe election failed error=%s", exc)
                    self.lock.release()
                    self._pause(1.0)
                    continue
                if not won:
                    if self.one_shot and view.state == BreakerState.OPEN:
                        m.request_stop("breaker_open")
                        return
                    self._pause(min(1.0, m.settings.breaker_heartbeat))
                    continue
                logger.info("prober elected member=%s epoch=%d", m.name, view.epoch)
                try:
                    if self._lead():
                        return
                except (LostLock, DatabaseUnavailable) as exc:
                    logger.warning("prober stepped down error=%s", exc)
                    self._pause(min(1.0, m.settings.breaker_heartbeat))
                finally:
                    self._step_down()
        except DatabaseUnavailable:
            pass  # stopping while the database is away
        finally:
            self._step_down()
            self.conn.close()
            self.done.set()

    def _step_down(self) -> None:
        """Give the prober's name and the probe lock up. The session goes on (it is
        the member's own): both are unlocked, where closing a connection of its own
        used to free them."""
        with contextlib.suppress(LostLock, PgqError):
            self.lock.run(self.member.store.unset_prober)
        self.lock.release()

    def _pause(self, seconds: float) -> None:
        self.member.stopping.wait(seconds)

    def _hold(self, seconds: float) -> None:
        """Wait `seconds` (or until stopping) while leading, keeping the lock's session
        busy; raises `LostLock` as soon as the lock is gone."""
        deadline = self.clock() + seconds
        while not self.member.stopping.is_set():
            left = deadline - self.clock()
            if left <= 0:
                return
            self._pause(min(left, self.lock.keep_every))
            self.lock.check()

    # -- leading ----------------------------------------------------------------

    def _lead(self) -> bool:
        """Probe, close and reconcile while holding the lock; True when finished, False
        when the prober sits out the next election. Each step's decision is the pure
        `lead_move` or `judge_probe`; this loop does what they say."""
        m = self.member
        turns = 0  # systemic probe failures in a row under this election
        self.lock.run(m.store.set_prober)
        while not m.stopping.is_set():
            self.lock.check()
            view = self.conn.run(m.store.breaker)
            self.gate.see_group(view.state, view.epoch)
            owed = view.reconcile_epoch is not None
            move: LeadMove | None = lead_move(
                view.state, owed, view.probe_due, one_shot=self.one_shot
            )
            if move is LeadMove.RECONCILE and view.reconcile_epoch is not None:
                self._reconcile(view.reconcile_epoch, view.reconcile_from or 0)
                continue
            if move is LeadMove.WAIT:
                self._hold(0.2)
                continue
            if move is LeadMove.PROBE:
                outcome = self._probe(view.epoch)
                if outcome is None:  # not due after all, or nothing at all to probe with
                    move = self._nothing_to_probe(view.epoch)
                elif outcome.kind == OutcomeKind.DONE:
                    continue  # closed (the next turn reconciles), or the lock was lost
                else:
                    verdict = self._judged(view, outcome, turns)
                    turns, move = verdict.turns, verdict.then
            if move is LeadMove.STOP:
                m.request_stop("breaker_open")
                return True
            if move is LeadMove.FINISHED:
                return True
            if move is LeadMove.SIT_OUT:
                self.sitting_out = True
                return False
        return True

    def _nothing_to_probe(self, epoch: int) -> LeadMove | None:
        """No probe ran: close the group if nothing is left to probe with (what next:
        None, look again), else wait out the probe interval (a one-shot run stops)."""
        m, s = self.member, self.member.settings
        closed = self.conn.run(m.store.close_idle, epoch, s.breaker_max_refunds)
        if closed is not None:  # nothing left to probe: the OPEN holds nothing back
            self.gate.see_group(BreakerState.CLOSED, closed, by="nothing_to_probe")
            return None
        if self.one_shot:
            return LeadMove.STOP
        self._hold(s.breaker_probe_interval)
        return None

    def _judged(self, view: BreakerView, outcome: Outcome, turns: int) -> ProbeVerdict:
        """Store what a probe that did not succeed means (`judge_probe`): the next probe
        time, and the failure count or the rotation to another row."""
        m, s = self.member, self.member.settings
        verdict = judge_probe(
            outcome.error_class == ErrorClass.SYSTEMIC,
            view.probe_failures or 0,
            turns,
            interval=s.breaker_probe_interval,
            interval_max=s.breaker_probe_interval_max,
            prober_turns=s.breaker_prober_turns,
            one_shot=self.one_shot,
        )
        row_id = outcome.claimed.id
        if verdict.systemic:
            self.conn.run(m.store.probe_failed, view.epoch, verdict.delay, row_id)
            logger.warning(
                "probe failed epoch=%d failures=%d next_in=%.1fs",
                view.epoch,
                verdict.failures,
                verdict.delay,
            )
        else:
            # message or permanent failure (or a snooze): inconclusive. The row was
            # charged as usual; the next probe takes another row (rotation), after
            # the current interval, stored like a systemic failure's but not doubled
            self.conn.run(
                m.store.probe_again,
                view.epoch,
                verdict.delay,
                "inconclusive",
                row_id,
                outcome.error_class,
            )
            logger.info(
                "probe inconclusive epoch=%d class=%s next_in=%.1fs",
                view.epoch,
                outcome.error_class,
                verdict.delay,
            )
        if verdict.then is LeadMove.SIT_OUT:
            logger.info("prober sits out the next election after %d failed probes", verdict.turns)
        return verdict

    def _probe(self, epoch: int) -> Outcome | None:
        """Run one real message as the probe; returns its (written) outcome.

        A success closes the group at `epoch` in the same transaction, if this
        prober still holds its lock; else it only writes the row and frees the
        probe slot, so the member that holds the lock now probes at once. With
        transactional handlers that transaction is the handler's own.
        """
        m, s = self.member, self.member.settings
        row = self.conn.run(m.store.claim_probe, epoch, s.breaker_max_refunds, s.breaker_member_ttl)
        if row is None:
            return None
        m.hold([row])
        lost: list[LostLock] = []
        closes: list[int | None] = []

        def succeed(conn: Connection) -> bool:
            """The probe's success: closes the group at `epoch` if the lock holds."""
            try:
                self.lock.check()
            except LostLock as exc:
                lost.append(exc)
                return m.store.probe_done(conn, row)[0]
            written, closed = m.store.probe_succeeded(conn, row, epoch)
            closes.append(closed)
            return written

        try:
            outcome, written = self._run_probe(row, epoch, succeed)
            if written and closes and closes[-1] is not None:  # a close that committed
                self.gate.see_group(BreakerState.CLOSED, closes[-1], by="probe")
            if lost and outcome.kind == OutcomeKind.DONE:
                # it succeeded but may not close: free the slot for the member that
                # holds the lock now, and log the probe as it went
                self.conn.retrying(m.store.probe_again, epoch, 0.0, "succeeded", row.id)
        finally:
            m.let_go([row.lease])
        m.count_outcome(outcome, pending=False)
        if not written:
            logger.warning("probe outcome refused id=%d (lease lost)", row.id)
            m.count_refused(outcome)
        if lost:
            raise lost[0]
        return outcome

    def _run_probe(
        self, row: Claimed, epoch: int, succeed: Callable[[Connection], bool]
    ) -> tuple[Outcome, bool]:
        """`_handle_probe`, in a CONSUMER span when the member traces (`pgq.otel`)."""
        tracing = self.member.tracing
        if tracing is None:
            return self._handle_probe(row, epoch, succeed)
        with tracing.processing([row]) as span:
            outcome, written = self._handle_probe(row, epoch, succeed)
            span.finished([(outcome, str(outcome.kind) if written else otel.REFUSED)])
            return outcome, written

    def _handle_probe(
        self, row: Claimed, epoch: int, succeed: Callable[[Connection], bool]
    ) -> tuple[Outcome, bool]:
        """The handler on the probe row and its outcome written: (outcome, written).
        A success is written by `succeed`: after the handler, on the prober's
        connection, or with transactional handlers in the handler's transaction."""
        m, s = self.member, self.member.settings
        transactions = m.transactions
        if transactions is None:
            outcome = self._attempt(row, lambda proceed: m.handling.run(row), epoch)
            if outcome is None:
                outcome = self._timed_out(row)
            if outcome.kind == OutcomeKind.DONE:
                return outcome, self._write(outcome, succeed)
        else:
            attempt = self._attempt(
                row, lambda proceed: transactions.run(row, succeed, proceed), epoch
            )
            if attempt is None or attempt.ended == Ended.ABANDONED:
                outcome = self._timed_out(row)
            elif attempt.ended == Ended.COMMITTED:
                return attempt.outcome, True
            elif attempt.ended == Ended.REFUSED:
                return attempt.outcome, False
            elif attempt.ended == Ended.RELEASED:  # it could not run, or was rolled back
                exc = ConnectionError("the transactional probe did not run to its end")
                outcome = m.handling.failure(row, exc)
            elif attempt.ended == Ended.UNKNOWN:
                settled = commit_settled(
                    self.conn, m.store, [attempt.outcome], attempt.backend, m.halt
                )
                return attempt.outcome, row.lease in settled
            else:
                outcome = attempt.outcome
        return outcome, self._write(
            outcome, lambda conn: m.store.record_probe(conn, outcome, s.max_attempts)
        )

    def _timed_out(self, row: Claimed) -> Outcome:
        timeout = self.member.settings.handler_timeout
        exc = TimeoutError(f"probe ran longer than handler_timeout ({timeout:g}s)")
        return self.member.handling.failure(row, exc)

    def _write(self, outcome: Outcome, write: Callable[[Connection], bool]) -> bool:
        """Whether `write(conn)`, a store call that returns True when it wrote the
        probe's `outcome`, wrote it (in one transaction, retried while the database is
        away). Written like the acker's outcomes (`write_outcomes`): when the answer
        was lost to a cut connection and the retry finds the lease gone, the row tells
        whether the probe's own write committed (not refused) or another member
        reclaimed it."""
        lease = outcome.claimed.lease

        def once(conn: Connection, _: list[Outcome]) -> set[Lease]:
            return {lease} if write(conn) else set()

        return lease in write_outcomes(self.conn, self.member.store, once, [outcome])

    def _attempt(
        self, row: Claimed, work: Callable[[Callable[[], bool]], T], epoch: int
    ) -> T | None:
        """`work(proceed)` (the handler on the probe row) on a thread of its own,
        bounded by `handler_timeout`; its result, or None when it ran out of time.
        `proceed()` is what work that would commit asks first: True unless the
        time is up, and once it said True, the attempt is waited for to its end.

        While it runs (possibly longer than `breaker.member_ttl`) the lock's session
        is kept busy and the probe slot stays reserved (`RENEW_SHARE`). A lock lost
        meanwhile is left for `_probe` to find: the handler's outcome is written
        either way, and until then the slot stays this probe's, so a successor
        waits for it.
        """
        m = self.member
        timeout, ttl = m.settings.handler_timeout, m.settings.breaker_member_ttl
        result: list[T] = []
        decided = threading.Lock()
        fate: list[str] = []  # "commit" (work goes on to its end) or "late"

        def proceed() -> bool:
            with decided:
                if not fate:
                    fate.append("commit")
                return fate[0] == "commit"

        runner = threading.Thread(
            target=carrying(lambda: result.append(work(proceed))),
            name=PROBE_THREAD,
            daemon=True,
        )
        runner.start()
        started = self.clock()
        deadline, holding, renewing = started + timeout, True, True
        renewed = started
        while runner.is_alive():
            left = deadline - self.clock()
            if left <= 0:
                with decided:
                    if not fate:
                        fate.append("late")
                if fate[0] == "late":
                    break
                runner.join()  # it is committing: its outcome is the probe's
                break
            runner.join(min(left, self.lock.keep_every, ttl * RENEW_SHARE))
            if not runner.is_alive():
                break
            if holding:
                try:
                    self.lock.check()
                except LostLock:
                    holding = False
            if renewing:
                renewing = self._renew(row, epoch, renewed)
                renewed = self.clock()
        if self.probe_time is not None:  # a probe abandoned at its timeout included
            self.probe_time.observe(self.clock() - started)
        return result[0] if result else None

    def _renew(self, row: Claimed, epoch: int, renewed: float) -> bool:
        """Renew the probe slot (last renewed at `renewed`); False once it is lost for
        good (the group moved on). A renewal that fails, or comes back later than the
        slot lasts (the connection stalled), is logged: another member may have
        probed meanwhile."""
        ttl = self.member.settings.breaker_member_ttl
        try:
            kept = self.conn.run(self.member.store.renew_probe, epoch, ttl)
        except DatabaseUnavailable as cut:
            logger.warning("probe slot not renewed id=%d error=%s", row.id, cut)
            return True
        late = self.clock() - renewed
        if not kept:
            logger.warning("probe slot not renewed id=%d (the group moved on meanwhile)", row.id)
        elif late > ttl:
            logger.warning(
                "probe slot not renewed in time id=%d after=%.1fs (another probe may have run)",
                row.id,
                late,
            )
        return kept

    def _reconcile(self, close_epoch: int, from_epoch: int) -> None:
        """Refund the rows the outage charged in bounded batches (resumable). Finished
        only when no row it owes is left: a batch skips rows another transaction
        holds (a killed prober's batch runs on until the server sees its client gone)."""
        m, s = self.member, self.member.settings
        total, started = 0, time.monotonic()
        while not m.stopping.is_set():
            self.lock.check()
            n = self.conn.run(
                m.store.reconcile_batch,
                close_epoch,
                from_epoch,
                s.breaker_max_refunds,
                RECONCILE_BATCH,
            )
            total += n
            if n == 0:
                if not self.conn.run(
                    m.store.reconcile_done, close_epoch, from_epoch, s.breaker_max_refunds
                ):
                    # rows it owes are held by another transaction (or it was finished
                    # meanwhile): look again after a pause
                    logger.info("reconciliation waits for held rows close_epoch=%d", close_epoch)
                    self._hold(min(1.0, s.breaker_heartbeat))
                    return
                logger.info(
                    "reconciliation finished close_epoch=%d refunded=%d seconds=%.2f",
                    close_epoch,
                    total,
                    time.monotonic() - started,
                )
                return
