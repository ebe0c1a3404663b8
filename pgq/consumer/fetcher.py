"""The fetcher thread: claims batches of ready rows into the buffered-claim pool.

It claims only what the pool has room for (never more than `prefetch`
unstarted rows, at most `batch_size` per statement) and, when the group has
nothing ready, waits on LISTEN for a publisher's NOTIFY with a poll fallback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from pgq.consumer.gate import Gate
from pgq.consumer.member import Member, Role
from pgq.consumer.model import Claimed
from pgq.errors import DatabaseUnavailable
from pgq.sql.publish import notify_channel
from pgq.store import RoleConnection

logger = logging.getLogger("pgq.consumer")

DRAIN_RECHECK = 0.2
"""Seconds between checks while `until_empty` waits for other leases to expire."""

STOP_CHECK = 0.2
"""Longest stretch an idle fetcher listens without looking at its stop event."""


class Listener:
    """A LISTEN connection for the schema's publish channel (autocommit, outside the pool)."""

    def __init__(self, conninfo: str, schema: str, topic: str) -> None:
        self.conninfo = conninfo
        self.channel = notify_channel(schema)
        self.topic = topic
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def _connect(self) -> psycopg.Connection[tuple[object, ...]] | None:
        if self._conn is None:
            try:
                conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5)
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                self._conn = conn
            except psycopg.Error as exc:
                logger.warning("listen unavailable, polling instead error=%s", exc)
        return self._conn

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Wait up to `timeout` (or until `stop`) for a publish to this topic.

        True if one came, or if LISTEN only starts now: a publish committed
        before it sent us nothing, so the caller must look again first.
        """
        if self._conn is None:
            if self._connect() is None:
                stop.wait(timeout)
                return False
            return True
        conn = self._conn
        deadline = time.monotonic() + timeout
        try:
            while not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for note in conn.notifies(timeout=min(left, STOP_CHECK)):
                    if note.payload == self.topic:
                        return True
        except psycopg.Error:
            self.close()
        return False

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class Fetcher(Role):
    """Keeps the pool filled while the gates allow it."""

    def __init__(
        self,
        member: Member,
        listener: Listener,
        gate: Gate,
        release: Callable[[list[Claimed]], int],
    ) -> None:
        super().__init__(member, f"pgq-fetcher-{member.store.group}")
        self.listener = listener
        self.gate = gate
        self.release = release
        self.wake = threading.Event()
        """Set by other threads to make an idle fetcher claim at once."""

    def work(self) -> None:
        m = self.member
        conn = RoleConnection(m.engine, "fetcher", m.stop_claiming)
        capacity = m.pool.capacity
        want = max(1, min(m.settings.batch_size, capacity) // 2)
        try:
            while not m.stop_claiming.is_set():
                mode = "closed" if m.until_empty and self.gate.local.is_open else None
                mode = mode or self.gate.claim_mode()
                if mode != "normal":
                    self.release(m.pool.drain() + m.take_deferred())
                    if m.until_empty and self.gate.local.is_open:
                        m.request_stop("breaker_open")  # a cron run retries later (exit 75)
                        break
                    if mode == "probe" and not self._probe(conn):
                        break
                    self.wake.wait(0.2)
                    self.wake.clear()
                    continue
                self.release(m.take_deferred())
                free = m.pool.wait_for_space(want, timeout=0.5)
                free = min(free, self.gate.ramp(capacity) - len(m.pool))
                budget = m.budget()
                limit = min(m.settings.batch_size, free, budget if budget is not None else free)
                room = m.room()
                if room < limit:  # outcomes are not written as fast as rows finish
                    limit = room
                    if limit <= 0:
                        self.wake.wait(0.05)
                        self.wake.clear()
                if limit <= 0 or m.stop_claiming.is_set() or self.gate.is_open():
                    continue  # the gate may have closed while we waited for space
                try:
                    rows = conn.retrying(m.store.claim, limit, self.gate.epoch)
                except DatabaseUnavailable:
                    break
                if rows:
                    m.hold(rows)
                    m.pool.put_many(rows)
                    continue
                if m.until_empty:
                    if self._drained(conn):
                        m.request_stop("empty")
                        break
                    self.listener.wait(DRAIN_RECHECK, m.stop_claiming)
                    continue
                self.wake.clear()
                self.listener.wait(m.settings.poll_interval, m.stop_claiming)
        finally:
            self.listener.close()
            conn.close()

    def _probe(self, conn: RoleConnection) -> bool:
        """Claim one row as the local breaker's probe; False if the database went away."""
        m = self.member
        try:
            rows = conn.retrying(m.store.claim, 1, self.gate.epoch)
        except DatabaseUnavailable:
            self.gate.probe_not_claimed()
            return False
        if not rows:
            self.gate.probe_not_claimed()
            return True
        rows[0].probe = True
        m.hold(rows)
        m.pool.put_many(rows)
        return True

    def _drained(self, conn: RoleConnection) -> bool:
        """True when nothing is ready now and nothing is leased but by other live members."""
        m = self.member
        if not m.idle() or len(m.pool):
            return False
        try:
            swept = conn.retrying(m.store.sweep)
            state = conn.retrying(m.store.drain_state, m.settings.breaker_member_ttl)
        except DatabaseUnavailable:
            return False
        if swept.reclaimed:
            with m.lock:
                m.tally.reclaimed += swept.reclaimed
        return state.ready_now == 0 and state.held == 0 and m.idle()
