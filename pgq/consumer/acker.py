"""The acker thread: writes outcomes in batches, one statement per batch (two when
it mixes successes and failures), each committing by itself.

Outcomes that cannot be written because the database is away stay in memory
and are written when it is back. An outcome the database refuses (the lease
was lost: another member reclaimed the row) is logged and dropped: the
reclaimer's outcome stands.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pgq.consumer.member import Member, Role
from pgq.consumer.timing import ACK
from pgq.errors import DatabaseUnavailable, PgqError
from pgq.logcontext import get_logger
from pgq.records import Lease, Outcome, OutcomeKind
from pgq.store import GroupStore, RoleConnection

logger = get_logger("pgq.consumer")

LINGER = 0.002
"""Seconds the acker waits for more outcomes after the first of a batch: one write
(and one thread wake-up) per batch instead of one per fast handler."""

DONE = OutcomeKind.DONE
"""Read once: an enum member read through its class costs 0.1 us, once per outcome here."""

IDLE_WAIT = 1.0
"""Seconds an idle acker sleeps between checks (`stop()` wakes it at once)."""


def write_outcomes(
    conn: RoleConnection,
    store: GroupStore,
    write: Callable[..., set[Lease]],
    outcomes: list[Outcome],
    *args: Any,
    single: bool = False,
    give_up: threading.Event | None = None,
) -> set[Lease]:
    """`write(conn, outcomes, *args)` in one transaction (`single`: one statement that
    commits by itself), retried while the database is away, unless `give_up` (by
    default the connection's stop event) is set; the leases it applied.

    When the connection broke during the write, it may have committed all the same:
    after the retry, the outcomes it did not apply are looked up (`store.settled`),
    and those the database shows settled by their own lease count as applied, not
    as refused. The acker's batches and the prober's probe outcomes are written so."""
    try:
        return conn.run(write, outcomes, *args, single=single)
    except DatabaseUnavailable:
        if (give_up or conn.stop).is_set():
            raise
    applied = conn.retrying(write, outcomes, *args, single=single)
    unseen = [o for o in outcomes if o.claimed.lease not in applied]
    return applied | (conn.retrying(store.settled, unseen) if unseen else set())


class Acker(Role):
    """Drains the outcome queue into batched, fenced writes."""

    def __init__(self, member: Member) -> None:
        super().__init__(member, "pgq-acker")
        self.outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self.finish = threading.Event()
        """Set once no more outcomes will come: flush and leave."""
        self.unwritten = 0
        self.ack_time = member.histogram(ACK)
        """The outcome batches' write durations, while metrics are served (else None)."""

    def submit(self, outcome: Outcome) -> None:
        """Queue an outcome for the next batch."""
        self.outcomes.put(outcome)

    def write_queued(self, conn: RoleConnection) -> None:
        """Write the outcomes not yet taken for a batch on `conn`, from the caller's
        thread, as this thread would (refusals one by one, lost answers looked up):
        for `abort`, whose second signal cannot wait for this thread, which may be
        stuck behind a lock with the batch before. Each statement is tried once (the
        member is halted)."""
        taken: list[Outcome] = []
        while True:
            try:
                outcome = self.outcomes.get_nowait()
            except queue.Empty:
                break
            if outcome is not None:
                taken.append(outcome)
        for start in range(0, len(taken), self.member.settings.batch_size):
            batch = taken[start : start + self.member.settings.batch_size]
            self._settle(batch, self._write(conn, batch))

    def stop(self) -> None:
        """No more outcomes will come: write what is queued, then leave."""
        self.finish.set()
        self.outcomes.put(None)  # wakes a waiting acker at once

    def work(self) -> None:
        m = self.member
        conn = RoleConnection(m.links.work, "acker", m.halt)
        batch_size = m.settings.batch_size
        pending: list[Outcome] = []
        try:
            while True:
                if not pending:
                    try:
                        first = self.outcomes.get(timeout=IDLE_WAIT)
                    except queue.Empty:
                        first = None
                    if first is None:
                        if self.finish.is_set() and self.outcomes.empty():
                            return
                        continue
                    pending.append(first)
                linger_until = time.monotonic() + LINGER
                while len(pending) < batch_size:
                    left = linger_until - time.monotonic()
                    try:
                        more = self.outcomes.get(timeout=left) if left > 0 else None
                    except queue.Empty:
                        more = None
                    if more is None:
                        break
                    pending.append(more)
                started = time.monotonic() if self.ack_time is not None else 0.0
                try:
                    applied = self._write(conn, pending)
                except DatabaseUnavailable:
                    self.unwritten = len(pending) + self.outcomes.qsize()
                    logger.error("outcomes not written count=%d (database away)", self.unwritten)
                    return
                if self.ack_time is not None:
                    self.ack_time.observe(time.monotonic() - started)
                self._settle(pending, applied)
                pending = []
                if self.finish.is_set() and self.outcomes.empty():
                    return
        finally:
            conn.close()

    def _write(self, conn: RoleConnection, outcomes: list[Outcome]) -> set[Lease]:
        """Write a batch: its successes, then its failures, each one statement that
        commits by itself (so a retry after an outage never rewrites what committed)."""
        done = [o for o in outcomes if o.kind == DONE]
        if len(done) in (0, len(outcomes)):
            return self._write_part(conn, outcomes)
        failed = [o for o in outcomes if o.kind != DONE]
        return self._write_part(conn, done) | self._write_part(conn, failed)

    def _write_part(self, conn: RoleConnection, outcomes: list[Outcome]) -> set[Lease]:
        """Write outcomes of one statement; if the database refuses them (not an
        outage), write them one by one so one bad outcome cannot take the others with it."""
        try:
            return self._record(conn, outcomes)
        except DatabaseUnavailable:
            raise
        except PgqError as exc:
            if len(outcomes) == 1:
                return self._write_refused(conn, outcomes[0], exc)
            logger.warning("outcome batch refused count=%d error=%s", len(outcomes), exc)
        applied: set[Lease] = set()
        for outcome in outcomes:
            try:
                applied |= self._record(conn, [outcome])
            except DatabaseUnavailable:
                raise
            except PgqError as exc:
                applied |= self._write_refused(conn, outcome, exc)
        return applied

    def _record(self, conn: RoleConnection, outcomes: list[Outcome]) -> set[Lease]:
        """Write outcomes of one kind; the leases applied (`write_outcomes`; one try
        once the member is halted, as by `abort`, whose connection is not this one)."""
        m = self.member
        return write_outcomes(conn, m.store, m.store.record, outcomes, single=True, give_up=m.halt)

    def _write_refused(self, conn: RoleConnection, outcome: Outcome, exc: PgqError) -> set[Lease]:
        """The database refused this outcome: record the attempt as a message failure
        that says why; if even that is refused, leave the row to its lease."""
        logger.error("outcome refused by the database id=%d error=%s", outcome.claimed.id, exc)
        replacement = self.member.handling.failure(
            outcome.claimed, ValueError(f"pgq could not record the outcome: {exc}")
        )
        try:
            return self._record(conn, [replacement])
        except DatabaseUnavailable:
            raise
        except PgqError as again:
            logger.error(
                "outcome dropped id=%d error=%s (the lease will expire)", outcome.claimed.id, again
            )
            return set()

    def _settle(self, written: list[Outcome], applied: set[Lease]) -> None:
        m = self.member
        leases = [o.claimed.lease for o in written]
        refused = [o for o, lease in zip(written, leases, strict=True) if lease not in applied]
        for o in refused:
            logger.warning(
                "outcome refused id=%d outcome=%s reason=lease lost (reclaimed by another member)",
                o.claimed.id,
                o.kind,
            )
            m.count_refused(o)
        m.let_go(leases)
        with m.lock:
            m.outcomes_pending -= len(written)
