"""The fetcher thread: claims batches of ready rows into the buffered-claim pool.

It claims only what the pool has room for (never more than `prefetch`
unstarted rows, at most `batch_size` per statement) and, when the group has
nothing ready, waits on LISTEN for a publisher's NOTIFY with a poll fallback.
It also hands back, on the claims connection, the rows no worker started: when
a gate closes, and when the member stops.
"""

from __future__ import annotations

import threading
import time

from pgq.consumer.gate import Gate
from pgq.consumer.member import Member, Role
from pgq.consumer.prefetch import AdaptivePrefetch, claim_limit, claim_want
from pgq.consumer.timing import CLAIM
from pgq.errors import DatabaseUnavailable, PgqError
from pgq.logcontext import get_logger
from pgq.records import Claimed, DrainState
from pgq.settings import ADAPTIVE
from pgq.store import Listener, RoleConnection

logger = get_logger("pgq.consumer")

DRAIN_RECHECK = 0.2
"""Seconds between checks while `until_empty` waits for other leases to expire."""

IDLE_POLL = 0.002
"""Seconds between looks at whether this member's own last rows and outcomes are done."""


class Fetcher(Role):
    """Keeps the pool filled while the gates allow it."""

    def __init__(self, member: Member, gate: Gate) -> None:
        super().__init__(member, f"pgq-fetcher-{member.store.group}")
        self.gate = gate
        self.conn = RoleConnection(member.links.claims, "fetcher", member.stop_claiming)
        self.listener = Listener(member.links.session, member.store.topic)
        self.wake = threading.Event()
        """Set by other threads to make an idle fetcher claim at once."""
        self.claim_time = member.histogram(CLAIM)
        """The claim statements' durations, while metrics are served (else None)."""
        self._retries_until: float | None = None
        """With `wait_retries`: the monotonic time up to which due retries are waited for."""
        s = member.settings
        self.adaptive = (
            AdaptivePrefetch(s.effective_prefetch, 4 * s.batch_size, s.lease)
            if s.prefetch == ADAPTIVE
            else None
        )

    def work(self) -> None:
        m = self.member
        try:
            self._fetch()
        finally:
            # the member is stopping: whatever no worker started goes back now
            m.pool.shut()
            self.release(m.pool.drain() + m.take_deferred())
            self.conn.close()

    def _fetch(self) -> None:
        m, gate = self.member, self.gate
        capacity = m.pool.capacity
        want = claim_want(m.settings.batch_size, capacity)
        while not m.stop_claiming.is_set():
            if self.adaptive is not None:
                bound = self.adaptive.observe(m.tally.handled)
                if bound is not None:
                    self.release(m.pool.resize(bound))  # handlers slowed: no hoarding
                    capacity, want = bound, claim_want(m.settings.batch_size, bound)
            mode = "closed" if m.until_empty and gate.local.is_open else None
            mode = mode or gate.claim_mode()
            if mode != "normal":
                self.release(m.pool.drain() + m.take_deferred())
                if m.until_empty and gate.local.is_open:
                    m.request_stop("breaker_open")  # a cron run retries later (exit 75)
                    return
                if mode == "probe" and not self._probe():
                    return
                self.wake.wait(0.2)
                self.wake.clear()
                continue
            self.release(m.take_deferred())
            # an adaptive bound is looked at every 0.1 s even while the pool is full
            free = m.pool.wait_for_space(want, timeout=0.5 if self.adaptive is None else 0.1)
            limit, held_back = claim_limit(
                batch_size=m.settings.batch_size,
                free=free,
                ramped=gate.ramp(capacity) - len(m.pool),
                budget=m.budget(),
                room=m.room(),
            )
            if held_back:
                self.wake.wait(0.05)
                self.wake.clear()
            if limit <= 0 or m.stop_claiming.is_set() or gate.is_open():
                continue  # the gate may have closed while we waited for space
            m.freed.clear()  # what is let go from here on may free a key this claim missed
            try:
                rows = self._claim(limit)
            except DatabaseUnavailable:
                return
            if rows:
                m.hold(rows)
                m.pool.put_many(rows)
                continue
            if m.until_empty:
                if not self._wait_idle(DRAIN_RECHECK):
                    continue  # its own last rows still run: claim again meanwhile
                if gate.local.is_open or gate.claim_mode() != "normal":
                    continue  # a breaker tripped on those last rows: the loop's top decides
                if m.freed.is_set():
                    continue  # an ordered group: its own rows just freed their keys
                drained = self._drained()
                if drained is not None:
                    m.drained(drained.waiting_retry)
                    return
                # others' leases or retries to wait for: a NOTIFY may come
                self.listener.wait(DRAIN_RECHECK, m.stop_claiming)
                continue
            self.wake.clear()
            if m.store.ordered and m.in_flight():
                # the keys this member runs are what holds the rows back: claim again
                # when one of them is let go (a publish is heard at the next look)
                m.freed.wait(m.settings.poll_interval)
                continue
            self.listener.wait(m.settings.poll_interval, m.stop_claiming)

    def _claim(self, limit: int) -> list[Claimed]:
        """Claim up to `limit` rows (one statement, retried while the database is away);
        timed while metrics are served."""
        m = self.member
        if self.claim_time is None:
            return self.conn.retrying(m.store.claim, limit, self.gate.epoch, single=True)
        started = time.monotonic()
        rows = self.conn.retrying(m.store.claim, limit, self.gate.epoch, single=True)
        self.claim_time.observe(time.monotonic() - started)
        return rows

    def release(self, rows: list[Claimed]) -> int:
        """Hand unstarted rows back to ready (no charge); returns how many went back.

        Rows that cannot be released now (the database is away) stop being held
        (their leases are no longer extended: nobody will run them) and are tried
        again with the next release, until released or their leases have ended.
        """
        if not rows:
            return 0
        m = self.member
        leases = [row.lease for row in rows]
        m.let_go(leases)
        self.gate.released(rows)
        try:
            released = self.conn.run(m.store.release, leases)
        except PgqError as exc:
            logger.warning("could not release rows count=%d error=%s", len(rows), exc)
            m.retry_release(rows)
            return 0
        m.count_released(len(released))
        logger.info("released unstarted rows count=%d", len(released))
        return len(released)

    def _probe(self) -> bool:
        """Claim one row as the local breaker's probe; False if the database went away."""
        m = self.member
        try:
            rows = self.conn.retrying(m.store.claim, 1, self.gate.epoch, True)
        except DatabaseUnavailable:
            self.gate.probe_not_claimed()
            return False
        if not rows:
            self.gate.probe_not_claimed()
            return True
        m.hold(rows)
        m.pool.put_many(rows)
        return True

    def _wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` until this member has no row buffered or running and no
        outcome left to write; True when it got there. Polled every `IDLE_POLL`: the
        last handlers and the acker's last write take milliseconds, and a drain should
        end as soon as they are done, not a whole recheck later."""
        m = self.member
        deadline = time.monotonic() + timeout
        while not m.idle() or len(m.pool):
            if time.monotonic() >= deadline or m.stop_claiming.wait(IDLE_POLL):
                return False
        return True

    def _drained(self) -> DrainState | None:
        """The group's drain state when nothing is ready now, nothing is leased but by
        other live members, no reconciliation is owed (this member's prober makes it,
        or waits for the member making it), and, with `wait_retries`, no retry comes
        due in time; else None."""
        m = self.member
        if not m.idle() or len(m.pool):
            return None
        wait = 0.0
        if m.wait_retries > 0:
            now = time.monotonic()
            if self._retries_until is None:  # the first time the group looks empty
                self._retries_until = now + m.wait_retries
            wait = max(0.0, self._retries_until - now)
        try:
            swept = self.conn.retrying(m.store.sweep)
            state = self.conn.retrying(m.store.drain_state, m.settings.breaker_member_ttl, wait)
        except DatabaseUnavailable:
            return None
        if swept.reclaimed:
            m.count_reclaimed(swept.reclaimed)
        return state if state.empty and m.idle() else None
