"""One running member: its threads, how they are wired, and the fixed-order shutdown.

    fetcher ──claims──▶ buffered-claim pool ──▶ workers (handler) ──outcomes──▶ acker
    heartbeat: liveness, lease extension, quorum open, group state ──▶ gate;
               starts the prober
    maintenance: sweep, frontier, statistics, pruning, retention, handler timeouts,
                 the lag of the progress line, the metrics' group numbers
                 (housekeeping: gives up on a lock after a few seconds)
    progress: the progress line, from memory (never waits for the database)

Data flows one way: the gate tells its listeners (fetcher, pool, heartbeat)
when a breaker changes; workers take the gate and the acker directly; each
role owns its connection. Shutdown runs in a fixed order under one deadline:
stop claiming and dispatching, the fetcher releases what no worker started,
running handlers finish, outcomes are flushed, a last maintenance pass runs,
the member leaves the group.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

from pgq.consumer import numbers, progress
from pgq.consumer.acker import Acker
from pgq.consumer.fetcher import Fetcher
from pgq.consumer.gate import Gate
from pgq.consumer.heartbeat import Heartbeat
from pgq.consumer.maintenance import Maintenance
from pgq.consumer.member import REFUSALS, Member
from pgq.consumer.workers import Workers
from pgq.errors import DatabaseUnavailable, PgqError
from pgq.logcontext import carrying, get_logger
from pgq.records import Claimed, RunSummary
from pgq.store import RoleConnection, SessionLock, private_link

VACUUM_EVERY = 5.0
"""Seconds between a member's checks whether `delivery` needs a VACUUM (decision 0021)."""

RETENTION_EVERY = 60.0
"""Seconds between a member's retention passes (the first runs at start)."""

SAMPLE_EVERY = 20.0
"""Seconds between a member's looks whether this minute's chart sample of its group is
written (decision 0045): three a minute, so a late task run never misses a minute;
each but the one that writes reads one index entry."""

ABORT_WAIT = 2.0
"""Seconds the second signal waits for its writes and releases before it returns (and
`pgq consume` exits): what is not done by then is left to the leases' expiry."""

logger = get_logger("pgq.consumer")


class Runtime:
    """The threads of one started member."""

    def __init__(
        self, member: Member, gate: Gate, session: SessionLock, clock: Callable[[], float]
    ) -> None:
        s = member.settings
        self.member = member
        self.gate = gate
        self.session = session
        """The member's session lock: it is live while this connection holds it."""
        self.conn = RoleConnection(member.links.claims, "final", threading.Event())
        """For the final pass (no retries: each tries once), on the claims connection:
        claiming has stopped by then, and an outcome write stuck behind a lock may hold
        the work connection still. (The abort opens a connection of its own.)"""
        self.acker = Acker(member)
        self.workers = Workers(member, gate, self.acker, clock)
        self.fetcher = Fetcher(member, gate)
        self.heartbeat = Heartbeat(member, gate, session, clock)
        self.maintenance = Maintenance(member, clock)  # leases: the heartbeat extends them
        self.progress = progress.Progress(member, gate, clock)
        conn = self.maintenance.conn  # the progress line's lag: first, twice an interval
        lag = functools.partial(self.progress.read_lag, conn)
        self.maintenance.add("progress-lag", self.progress.every / 2, lag)
        self.maintenance.add("sweep", max(0.05, min(1.0, s.lease / 3)), self.maintenance.sweep)
        self.maintenance.add("frontier", 1.0, self.maintenance.advance_frontier)
        self.maintenance.add("statistics", 10.0, self.maintenance.refresh_statistics)
        self.maintenance.add("vacuum", VACUUM_EVERY, self.maintenance.vacuum)
        self.maintenance.add("prune", 60.0, self.maintenance.prune)
        self.maintenance.add("retention", RETENTION_EVERY, self.maintenance.expire_messages)
        self.maintenance.add("forget-members", 60.0, self.maintenance.forget_members)
        self.maintenance.add("sample", SAMPLE_EVERY, self.maintenance.sample)
        self.maintenance.add(
            "handler-timeouts", min(0.5, s.handler_timeout / 4), self.workers.check_timeouts
        )
        if member.numbers is not None:  # metrics are served: their group numbers
            refresh = member.numbers.refresher(conn, member.store.group, s, clock)
            self.maintenance.add("group-numbers", numbers.REFRESH_EVERY, refresh)
        gate.on_change(self.fetcher.wake.set)
        gate.on_change(member.pool.wake)  # a fetcher waiting for space re-checks the gate
        gate.on_change(self.heartbeat.poke)
        self.clean = True
        """False after a shutdown that left handlers running or outcomes unwritten."""
        self._final_refusal: PgqError | None = None

    @property
    def refused(self) -> PgqError | None:
        """Why the member stopped when the database refused its work for good (a
        missing privilege, ...): `Consumer.run()` raises it."""
        return self.member.refused or self._final_refusal

    def start(self) -> None:
        self.acker.start()
        self.workers.start()
        self.heartbeat.start()
        self.maintenance.start()
        self.progress.start()
        self.fetcher.start()

    def abort(self) -> None:
        """Second signal: stop dispatching, make every database retry give up, then on
        a thread of its own and a connection of its own write the outcomes already
        queued (the acker's write, one try each) and release what is buffered or
        deferred. Waits for that at most `ABORT_WAIT` seconds.

        Not on this thread's connections: the signal may have interrupted this very
        thread inside a statement on one of them (the final pass), and the acker may
        be stuck behind a lock on another; a fresh session also outlives a cut that
        killed the idle ones, and a stalled network costs the bounded wait, not a hang.
        """
        m = self.member
        m.request_stop("signal")
        m.pool.shut()
        m.halt.set()
        rows = m.pool.drain() + m.take_deferred()
        writer = threading.Thread(
            target=carrying(functools.partial(self._write_and_release, rows)),
            name="pgq-abort",
            daemon=True,
        )
        writer.start()
        writer.join(ABORT_WAIT)
        if writer.is_alive():
            logger.warning(
                "abort gave up waiting for its writes seconds=%g (the leases will expire)",
                ABORT_WAIT,
            )

    def _write_and_release(self, rows: list[Claimed]) -> None:
        m = self.member
        link = private_link(m.links.claims.engine, "abort")
        try:
            conn = RoleConnection(link, "abort", threading.Event())
            self.acker.write_queued(conn)
            if rows:
                released = conn.run(m.store.release, [row.lease for row in rows])
                m.count_released(len(released))
        except PgqError as exc:
            logger.warning("abort could not write or release everything error=%s", exc)
        finally:
            link.close()
        self.session.release()

    def shutdown(self, grace: float) -> int:
        """Stop in the fixed order under one deadline; returns the rows waiting for a retry."""
        m = self.member
        deadline = time.monotonic() + grace
        m.request_stop("signal")
        m.pool.shut()  # no worker starts another row; the fetcher releases them
        self.fetcher.join(max(0.0, deadline - time.monotonic()))
        overran = self.workers.join(deadline)
        self.acker.stop()
        self.acker.join(max(1.0, deadline - time.monotonic()))
        m.halt.set()
        self.acker.join(5.0)
        self.maintenance.stop()
        self.progress.stop()
        self.maintenance.join(5.0)
        self.heartbeat.stop()
        self.heartbeat.join(5.0)
        prober = self.heartbeat.prober
        if prober is not None:
            prober.join(max(1.0, deadline - time.monotonic()))
        for name, thread in (("fetcher", self.fetcher), ("acker", self.acker)):
            if thread.is_alive():
                logger.warning("thread overran shutdown thread=%s", name)
        if overran:
            logger.warning(
                "handlers still running at the end of the grace period count=%d", len(overran)
            )
        self.clean = (
            not overran
            and self.acker.unwritten == 0
            and not self.acker.is_alive()
            and not m.crashed
        )
        try:
            return self._final_pass(deadline)
        finally:
            self.session.release()
            m.links.close()

    def _final_pass(self, deadline: float) -> int:
        """Advance the frontier, run the retention pass the run was due and did not
        complete (after the advance: rows just finished count), leave the group;
        return rows waiting for a retry (for a drained run: those the drain left,
        though some may have come due since)."""
        m = self.member
        store, ttl = m.store, m.settings.breaker_member_ttl
        try:
            self.conn.run(store.advance_frontier)
            self.maintenance.final_retention(deadline - time.monotonic())
            self.conn.run(store.leave)
            waiting = self.conn.run(store.drain_state, ttl).waiting_retry
            return waiting if m.drained_waiting is None else m.drained_waiting
        except REFUSALS as exc:
            logger.error("final maintenance pass refused error=%s", exc)
            self._final_refusal = exc
            return 0
        except DatabaseUnavailable as exc:
            logger.warning("final maintenance pass failed error=%s", exc)
            return m.drained_waiting or 0

    def summary(self, waiting: int) -> RunSummary:
        """The running counts as a `RunSummary`."""
        m = self.member
        with m.lock:
            t = m.tally
            return RunSummary(
                handled=t.handled,
                done=t.done,
                retried=t.retried,
                dead=t.dead,
                released=t.released,
                reclaimed=t.reclaimed,
                waiting_retry=waiting,
                stop_reason=m.stop_reason or "signal",
                refused=t.refused,
            )
