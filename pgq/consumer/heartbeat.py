"""The heartbeat thread: the member's liveness, its leases and its view of the
group breaker.

Every `breaker.heartbeat` seconds (at once when a breaker changes) it checks
that the member's session lock is still held (taking it again if not), records
the member's liveness and local breaker state, opens the group when the
quorum of tripped live members is there (one conditional statement), feeds
the group state to the gate, and starts the prober while the group is OPEN or
a reconciliation is owed. Every `lease / 3` seconds it extends the leases of
the rows the member holds. It runs on the member's session connection (with
the locks and LISTEN; never housekeeping's), and none of its statements
waits on locks that callers or housekeeping hold for long, so a
housekeeping pass stuck behind a lock (retention behind a caller's open
`subscribe`) never delays a heartbeat nor a lease extension (decision 0025).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Connection

from pgq.breaker import needs_prober, should_try_open
from pgq.consumer.gate import Gate
from pgq.consumer.maintenance import Task, run_task
from pgq.consumer.member import Member, Role
from pgq.consumer.prober import Prober
from pgq.errors import DatabaseUnavailable, LockNotAvailable, TransactionConflict
from pgq.logcontext import get_logger
from pgq.records import BreakerState, BreakerView
from pgq.store import LostLock, RoleConnection, SessionLock

logger = get_logger("pgq.breaker")

HEARTBEAT_LOCK_TIMEOUT_MAX = 1.0
"""Longest a heartbeat statement waits for a lock (`lock_timeout`), and at most a
tenth of the lease: a quorum flip that meets a held breaker row or flip lock (a
purge, a stopped member mid-flip) gives up and is tried at the next beat, and the
lease extension on this thread never falls a whole period behind (decision 0025)."""


class Heartbeat(Role):
    """Beats until `stop()`; owns the member's prober thread."""

    def __init__(
        self,
        member: Member,
        gate: Gate,
        session: SessionLock,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(member, "pgq-heartbeat")
        self.gate = gate
        self.session = session
        self.clock = clock
        self.finish = threading.Event()
        self._poked = threading.Event()
        self.conn = RoleConnection(
            member.links.session,
            "heartbeat",
            self.finish,
            lock_timeout=min(HEARTBEAT_LOCK_TIMEOUT_MAX, member.settings.lease / 10),
        )
        self.prober: Prober | None = None
        self._failing = False
        self.extension = Task(
            "extend-leases", max(0.05, member.settings.lease / 3), self.extend_leases
        )
        """Lease extension: a task of its own on this thread (a failure is logged and
        tried again at the next period, a refusal stops the member)."""

    def poke(self) -> None:
        """Beat as soon as possible (a breaker changed)."""
        self._poked.set()

    def stop(self) -> None:
        self.finish.set()
        self._poked.set()

    def work(self) -> None:
        interval = self.member.settings.breaker_heartbeat
        extension = self.extension
        beat_due = self.clock()
        try:
            while not self.finish.is_set():
                if self._poked.is_set() or self.clock() >= beat_due:
                    self._poked.clear()
                    self._beat_logged()
                    beat_due = self.clock() + interval
                if not self.finish.is_set() and self.clock() >= extension.due:
                    run_task(extension, self.member, "heartbeat")
                    extension.due = self.clock() + extension.interval
                self._poked.wait(max(0.0, min(beat_due, extension.due) - self.clock()))
        finally:
            self.conn.close()

    def extend_leases(self) -> None:
        """Keep the leases of every held row (buffered or running) alive."""
        m = self.member
        leases = m.leases()
        if not leases:
            return
        began = time.monotonic()
        kept = self.conn.run(m.store.extend, leases)
        lost = [lease for lease in leases if lease not in kept]
        m.leases_kept(began, lost)
        if lost:
            # written meanwhile (fine) or reclaimed by someone else (fenced)
            with m.lock:
                still_held = [lease.id for lease in lost if lease in m.held]
            if still_held:
                logger.debug("leases no longer held ids=%s", still_held[:20])

    def _beat_logged(self) -> None:
        try:
            self.beat()
        except DatabaseUnavailable as exc:
            if not self._failing:
                logger.warning("heartbeat failed error=%s", exc)
            self._failing = True
            return
        except TransactionConflict as exc:  # a lock held too long, a deadlock: next beat
            reason = "lock_timeout" if isinstance(exc, LockNotAvailable) else "conflict"
            logger.log(
                logging.INFO if self._failing else logging.WARNING,
                "heartbeat deferred reason=%s group=%s member=%s error=%s",
                reason,
                self.member.store.group,
                self.member.name,
                exc,
            )
            self._failing = True
            return
        if self._failing:
            logger.info("heartbeat recovered")
        self._failing = False

    def hold_session(self) -> None:
        """Make sure the member's session lock is held (its liveness), taking it
        again after a lost connection, or once a stale holder's session ended."""
        try:
            self.session.check()
        except LostLock:
            self.session.release()
            if self.session.acquire():
                logger.info("member session lock taken member=%s", self.member.name)

    def beat(self) -> None:
        """Record liveness and the local breaker; open the group on quorum; follow it."""
        m, gate, s = self.member, self.gate, self.member.settings
        self.hold_session()
        local, tripped = gate.local_report()

        def beat(conn: Connection) -> tuple[BreakerView, int | None] | None:
            if m.store.heartbeat(conn, local, tripped) is None:
                return None
            view = m.store.breaker(conn)
            if should_try_open(view.state, local, tripped, view.epoch):
                opened = m.store.open_on_quorum(
                    conn,
                    view.epoch,
                    ttl=s.breaker_member_ttl,
                    min_members=s.breaker_min_members,
                    quorum=s.breaker_quorum,
                )
                return view, opened
            return view, None

        beaten = self.conn.run(beat)
        if beaten is None:
            logger.error(
                "member name taken over by another process, or its group removed"
                " (pgq unsubscribe) member=%s; stopping",
                m.name,
            )
            m.request_stop("signal")
            self.finish.set()
            return
        view, opened = beaten
        if opened is not None:
            gate.see_group(BreakerState.OPEN, opened, by="quorum")
        else:
            gate.see_group(view.state, view.epoch)
        if needs_prober(gate.group_state, view.reconcile_epoch is not None):
            self._ensure_prober()

    def _ensure_prober(self) -> None:
        prober = self.prober
        if prober is not None and prober.is_alive():
            return
        if self.member.stopping.is_set():
            return
        self.prober = Prober(
            self.member, self.gate, one_shot=self.member.until_empty, clock=self.clock
        )
        self.prober.start()
