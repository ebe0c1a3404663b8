"""State one consumer member shares between its threads, and the thread base."""

from __future__ import annotations

import abc
import math
import threading
from dataclasses import dataclass, field

from pgq.consumer.handling import Handling
from pgq.consumer.numbers import GroupNumbers
from pgq.consumer.pool import ClaimPool
from pgq.consumer.timing import Histogram, Timings
from pgq.consumer.transactions import Transactions
from pgq.errors import BadDsn, PermissionDenied, PgqError, SchemaMissing
from pgq.logcontext import get_logger, log_fields
from pgq.otel.tracing import ConsumerTracing
from pgq.records import Claimed, Lease, Outcome, OutcomeKind, StopReason
from pgq.settings import Settings
from pgq.store import GroupStore, MemberLinks, RoleConnection
from pgq.store.privileges import require_consumer_privileges

logger = get_logger("pgq.consumer")

# read once per message: an enum member read through its class costs 0.1 us
DONE, DEAD, SNOOZE = OutcomeKind.DONE, OutcomeKind.DEAD, OutcomeKind.SNOOZE

REFUSALS = (PermissionDenied, SchemaMissing, BadDsn)
"""Errors no retry fixes: a missing privilege, the schema gone, the login refused.
A thread that meets one stops the member, and `run()` raises it."""


@dataclass
class Tally:
    """Running counts for the run summary (guarded by the member's lock)."""

    handled: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    reclaimed: int = 0
    refused: int = 0


LEASE_TRUST = 0.75
"""The part of a lease, from its claim or its last extension, within which a member
trusts a held row's lease without asking: extensions run every third of a lease, so
a member that runs normally is always within it."""


@dataclass
class Member:
    """Everything a member's threads share: settings, the store, the pool, the
    rows it holds, the stop signals and the running counts."""

    links: MemberLinks
    """The member's three connections (`pgq.store.connections`)."""
    settings: Settings
    store: GroupStore
    handling: Handling
    topic_id: int
    pool: ClaimPool[Claimed]
    until_empty: bool = False
    max_messages: int | None = None
    wait_retries: float = 0.0
    """With `until_empty`: also wait for retries due within this long."""
    stop_claiming: threading.Event = field(default_factory=threading.Event)
    """Set first on shutdown: the fetcher claims nothing more."""
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set when a stop was asked for (by `stop()`, a limit, or an empty group)."""
    halt: threading.Event = field(default_factory=threading.Event)
    """Set last: database retries give up, every thread leaves."""
    stop_reason: StopReason | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[Lease, Claimed] = field(default_factory=dict)
    """Rows this member holds a lease on (buffered or running), by lease: a stale
    copy of a message can never shadow the member's newer lease on it."""
    tally: Tally = field(default_factory=Tally)
    deferred: list[Claimed] = field(default_factory=list)
    """Rows waiting to be released: buffered rows a closed gate turned away at
    dispatch, and rows a release could not hand back (the database was away)."""
    crashed: list[str] = field(default_factory=list)
    """Threads that died of an unexpected error (the member then stops, unclean)."""
    refused: PgqError | None = None
    """The first refusal that stopped the member (see `REFUSALS`): `run()` raises it."""
    outcomes_pending: int = 0
    """Outcomes handed to the acker and not yet written."""
    drained_waiting: int | None = None
    """Rows waiting for a retry when the drain found the group empty: what the run
    leaves for a later run (counted then: some come due before the final pass)."""
    transactions: Transactions | None = None
    """With `Consumer(..., transactional=True)`: runs the handler in a transaction
    that commits its writes with the message's outcome (`pgq.consumer.transactions`)."""
    timings: Timings | None = None
    """The latency histograms, while metrics are served (`Consumer.measure()`); None
    otherwise, and then nothing is timed."""
    numbers: GroupNumbers | None = None
    """The group's numbers for the metrics, while they are served (`Consumer.measure()`):
    a maintenance task keeps them fresh (`pgq.consumer.numbers`)."""
    tracing: ConsumerTracing | None = None
    """Each handler call's CONSUMER span, with the `otel` extra and a tracer provider
    set (`pgq.otel`); None otherwise, and then nothing is traced."""
    leases_kept_at: float = -math.inf
    """When the last lease extension that answered began (`time.monotonic()`): the
    leases it kept hold until a lease after it (`lease_lapsed`)."""
    lost: set[Lease] = field(default_factory=set)
    """Held rows whose lease an extension found gone (taken over after it expired)."""
    freed: threading.Event = field(default_factory=threading.Event)
    """In an ordered group, set when rows this member held were let go (their outcome
    written, or released): their keys may be free, so the fetcher claims again at
    once instead of waiting for a publish or its poll (decision 0044)."""

    @property
    def name(self) -> str:
        return self.store.member

    def histogram(self, kind: str) -> Histogram | None:
        """A histogram of `kind` for the calling role to write alone (`pgq.consumer.timing`),
        or None when nothing is timed."""
        return None if self.timings is None else self.timings.histogram(kind)

    def in_flight(self) -> int:
        """Rows this member holds a lease on now: buffered, running, or waiting for
        their outcome to be written."""
        with self.lock:
            return len(self.held)

    def request_stop(self, reason: StopReason) -> None:
        """Ask the member to stop; the first reason given wins."""
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        self.stopping.set()
        self.stop_claiming.set()
        self.pool.wake()

    def refuse(self, thread: str, exc: PgqError) -> None:
        """The database refused this member's work for good (see `REFUSALS`): stop
        the member, keep the first refusal for `run()` to raise, log one line.
        PostgreSQL names only the table a privilege is missing on: a refusal for
        a privilege is replaced by the check that names every missing one."""
        if isinstance(exc, PermissionDenied):
            try:
                RoleConnection(self.links.work, "refusal", self.halt).run(
                    require_consumer_privileges
                )
            except PermissionDenied as named:
                exc = named
            except PgqError:
                pass
        with self.lock:
            if self.refused is None:
                self.refused = exc
        self.request_stop("signal")
        logger.error(
            "database refused thread=%s member=%s error=%s; stopping", thread, self.name, exc
        )

    def drained(self, waiting_retry: int) -> None:
        """The group is empty but for `waiting_retry` rows waiting for a later retry."""
        with self.lock:
            if self.stop_reason is None:
                self.drained_waiting = waiting_retry
        self.request_stop("empty")

    def crash(self, thread: str) -> None:
        """A thread died of an unexpected error: stop the whole member, then log it
        (logging a hostile exception can fail too; the stop must not depend on it)."""
        with self.lock:
            self.crashed.append(thread)
        self.request_stop("signal")
        try:
            logger.exception("thread crashed thread=%s member=%s; stopping", thread, self.name)
        except Exception:
            logger.error("thread crashed thread=%s member=%s; stopping", thread, self.name)

    def hold(self, rows: list[Claimed]) -> None:
        """Remember freshly claimed rows (their leases are extended until written)."""
        with self.lock:
            for row in rows:
                self.held[row.lease] = row

    def let_go(self, leases: list[Lease]) -> None:
        """Forget rows whose outcome was written or that were released."""
        with self.lock:
            for lease in leases:
                self.held.pop(lease, None)
            if self.lost:
                self.lost.difference_update(leases)
        if self.store.ordered:
            self.freed.set()

    def leases_kept(self, began: float, lost: list[Lease]) -> None:
        """An extension begun at `began` kept every lease it was given but `lost`."""
        with self.lock:
            self.leases_kept_at = began
            self.lost.update(lease for lease in lost if lease in self.held)

    def lease_lapsed(self, row: Claimed, now: float) -> bool:
        """`row`'s lease may have expired, so another member may run it: its claim and
        the last extension that kept it are both more than `LEASE_TRUST` of a lease
        ago (a member paused or cut off past its lease), or an extension found it
        gone. Such a row must not start: in an ordered group the next message of its
        key may already run (decision 0044); elsewhere it would run twice."""
        trusted = self.settings.lease * LEASE_TRUST
        if now - row.claimed_at < trusted:
            return False
        with self.lock:
            return row.lease in self.lost or now - self.leases_kept_at >= trusted

    def defer(self, row: Claimed) -> None:
        """A closed gate turned `row` away: release it with the next batch."""
        with self.lock:
            self.deferred.append(row)

    def retry_release(self, rows: list[Claimed]) -> None:
        """A release failed: try these rows again with the next one (no longer held,
        so their leases are not extended meanwhile)."""
        with self.lock:
            self.deferred.extend(rows)

    def take_deferred(self) -> list[Claimed]:
        with self.lock:
            rows, self.deferred = self.deferred, []
            return rows

    def leases(self) -> list[Lease]:
        """The lease of every row this member holds."""
        with self.lock:
            return list(self.held)

    def count_released(self, n: int) -> None:
        with self.lock:
            self.tally.released += n

    def count_reclaimed(self, n: int) -> None:
        with self.lock:
            self.tally.reclaimed += n

    def budget(self) -> int | None:
        """How many more rows may be claimed under `max_messages` (None: no limit)."""
        if self.max_messages is None:
            return None
        with self.lock:
            return max(0, self.max_messages - self.tally.handled - len(self.held))

    def room(self) -> int:
        """How many more rows the member may hold: buffered, running, or waiting for
        their outcome to be written. Bounds what a slow acker lets pile up (all of
        it would be delivered again after a crash)."""
        s = self.settings
        most = self.pool.capacity + s.workers + 2 * s.batch_size
        with self.lock:
            return max(0, most - len(self.held))

    def idle(self) -> bool:
        """Nothing buffered, running or waiting to be written."""
        with self.lock:
            return not self.held and self.outcomes_pending == 0

    def count_refused(self, outcome: Outcome) -> None:
        """The database refused `outcome` (the lease was lost): it is not what became
        of the message, so it moves from its kind's count to `refused`."""
        with self.lock:
            t = self.tally
            t.refused += 1
            if outcome.kind == OutcomeKind.DONE:
                t.done -= 1
            elif outcome.kind == OutcomeKind.DEAD:
                t.dead -= 1
            else:
                t.retried -= 1

    def count_outcome(self, outcome: Outcome, pending: bool = True) -> None:
        """Count a finished attempt or snooze; `pending`: the acker still has to write it."""
        with self.lock:
            if pending:
                self.outcomes_pending += 1
            kind = outcome.kind
            if kind == SNOOZE:
                self.tally.retried += 1
                return
            self.tally.handled += 1
            if kind == DONE:
                self.tally.done += 1
            elif kind == DEAD:
                self.tally.dead += 1
            else:
                self.tally.retried += 1
            reached = self.max_messages is not None and self.tally.handled >= self.max_messages
        if reached:
            self.request_stop("max_messages")


class Role(threading.Thread, abc.ABC):
    """A member's thread: `work()` runs guarded, so an unexpected error stops the
    whole member (logged, shutdown unclean) instead of leaving it half alive, and
    with its log events bound to the member's group and name (`pgq.logcontext`)."""

    def __init__(self, member: Member, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.member = member

    def run(self) -> None:
        m = self.member
        with log_fields(group=m.store.group, member=m.name):
            try:
                self.work()
            except REFUSALS as exc:
                m.refuse(self.name, exc)
            except Exception:
                m.crash(self.name)

    @abc.abstractmethod
    def work(self) -> None:
        """The thread's loop."""
