"""Drivers that publish, subscribe and run retention concurrently, and record what they did.

    with Drivers(engine, "chaos", seconds=10) as drivers:
        drivers.publish(threads=3, tx_threads=1, count=2000)
        drivers.subscribe(count=3, interval=2.0)
        drivers.retain(interval=0.5)
        ...                                   # faults meanwhile
        drivers.wait(timeout=30)              # every driver done; raises on a driver error
    record = drivers.record                   # for history.check(...)

Every driver is bounded by a count and by the deadline (`seconds` from start),
and stops at once when the `with` block ends. The drivers talk to PostgreSQL
directly (not through the chaos proxy): what they record must be certain.

- Publishers: `threads` threads. `tx_threads` of them publish inside explicit
  transactions that commit out of id order (open A, publish; open B, publish;
  commit B; commit A), the rest publish single messages and small batches on
  the engine. Each id is recorded with the wall-clock times its publish began
  and its commit returned.
- Subscribers: a new group `<prefix><n>` with `start="earliest"` every
  `interval` seconds; recorded with the call's times and the topic's message
  ids present right after it returned (so the checker can tell a message that
  retention deleted before the group existed from one the group lost).
  `on_subscribe(group)` runs after each (e.g. to start a consumer for it).
- Retention: the production retention statement (`retention` seconds, default 0)
  every `interval` seconds, batch after batch; the deleted ids are recorded.
"""

from __future__ import annotations

import functools
import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from sqlalchemy import Engine, select

import pgq
from pgq import schema as t
from pgq.errors import StatementTimeout, TransactionConflict

REFUSED = (TransactionConflict, StatementTimeout)
"""What a publisher survives: the publish did not commit, and it goes on (counted)."""


@dataclass(frozen=True)
class Published:
    id: int
    topic: str
    thread: str
    began: float  # wall clock before the publish (or its transaction) began
    committed: float  # wall clock after the commit returned
    in_tx: bool


@dataclass(frozen=True)
class Subscription:
    group: str
    topic: str
    began: float
    returned: float
    present_after: frozenset[int]  # the topic's message ids right after it returned


@dataclass(frozen=True)
class RetentionPass:
    began: float
    ended: float
    deleted: tuple[int, ...]


@dataclass
class Record:
    """What the drivers did; thread-safe appends."""

    published: list[Published] = field(default_factory=list)
    subscriptions: list[Subscription] = field(default_factory=list)
    retention: list[RetentionPass] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # publishes refused and retried
    refused_at: list[float] = field(default_factory=list)  # when each of them failed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, what: Published | Subscription | RetentionPass) -> None:
        with self.lock:
            if isinstance(what, Published):
                self.published.append(what)
            elif isinstance(what, Subscription):
                self.subscriptions.append(what)
            else:
                self.retention.append(what)

    def ids(self, topic: str | None = None) -> list[int]:
        """Every id published (to `topic`), sorted."""
        with self.lock:
            return sorted(p.id for p in self.published if topic is None or p.topic == topic)

    def deleted(self) -> set[int]:
        """Every id a retention pass deleted."""
        with self.lock:
            return {mid for r in self.retention for mid in r.deleted}

    def subscription(self, group: str) -> Subscription | None:
        with self.lock:
            return next((s for s in self.subscriptions if s.group == group), None)

    def groups_before(self, pub: Published) -> list[str]:
        """Driver groups whose subscribe returned before `pub` began."""
        return [s.group for s in self.subscriptions if s.returned < pub.began]

    def groups_after(self, pub: Published) -> list[str]:
        """Driver groups whose subscribe began after `pub` committed."""
        return [s.group for s in self.subscriptions if s.began > pub.committed]

    def out_of_order_commits(self) -> int:
        """Pairs of consecutive commits in which the later commit has the lower id."""
        with self.lock:
            ordered = sorted(self.published, key=lambda p: p.committed)
        return sum(1 for a, b in itertools.pairwise(ordered) if b.id < a.id)

    def describe(self) -> str:
        with self.lock:
            return (
                f"published={len(self.published)}"
                f" in_tx={sum(p.in_tx for p in self.published)}"
                f" subscribed={[s.group for s in self.subscriptions]}"
                f" retention_passes={len(self.retention)}"
                f" retained={sum(len(r.deleted) for r in self.retention)}"
                f" errors={len(self.errors)}"
                + (f" conflicts={len(self.conflicts)}" if self.conflicts else "")
            )


def topic_id(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(t.topic.c.id).where(t.topic.c.name == topic)).scalar_one())


def message_ids(engine: Engine, topic: str) -> set[int]:
    """Ids of the messages of `topic` present now."""
    m, tid = t.message, topic_id(engine, topic)  # by id: the topic's shard on Citus
    with engine.connect() as conn:
        return set(conn.execute(select(m.c.id).where(m.c.topic_id == tid)).scalars())


def refusal(exc: BaseException) -> bool:
    """Did the database refuse a statement (a deadlock, a statement timeout), rolling
    its transaction back, whether pgq translated the error or not?"""
    cause = getattr(exc, "orig", None)
    return isinstance(exc, REFUSED) or isinstance(
        cause, (psycopg.errors.QueryCanceled, psycopg.errors.DeadlockDetected)
    )


def retention_pass(
    engine: Engine,
    topic: str,
    retention: float = 0.0,
    batch: int = 1000,
    max_batches: int = 20,
    refused: Callable[[Exception], None] | None = None,
) -> list[int]:
    """Run pgq's retention for `topic` until it deletes nothing; the deleted ids.
    A batch the database refuses (while a shard moves, say) ends the pass after
    `refused` is told, with the ids of the batches committed before it.

    The same two statements as `GroupStore.expire_messages` (the topic lock, then
    the delete), kept here because the checker needs the ids, not only a count.
    On a Citus schema retention takes other steps (decision 0023): there it is
    `GroupStore.expire_messages` itself, and the ids are the ones gone after it.
    """
    import datetime as dt

    from pgq.sql.frontier import delete_expired_messages, lock_topic_for_retention
    from pgq.store import placement

    tid = topic_id(engine, topic)
    if placement.distributed(engine):
        return _retention_pass_by_store(engine, topic, tid, retention, batch, max_batches, refused)
    deleted: list[int] = []
    for _ in range(max_batches):
        try:
            with engine.begin() as conn:
                conn.execute(lock_topic_for_retention(), {"topic_id": tid})
                got = conn.execute(
                    delete_expired_messages(),
                    {"topic_id": tid, "retention": dt.timedelta(seconds=retention), "limit": batch},
                ).scalars()
                ids = [int(i) for i in got]
        except Exception as exc:
            if refused is None or not refusal(exc):
                raise
            refused(exc)
            break
        deleted += ids
        if len(ids) < batch:
            break
    return deleted


def _retention_pass_by_store(
    engine: Engine,
    topic: str,
    tid: int,
    retention: float,
    batch: int,
    max_batches: int,
    refused: Callable[[Exception], None] | None,
) -> list[int]:
    """`retention_pass` through the member's own retention (`GroupStore.expire_messages`);
    the deleted ids are those present before and gone after (a member's maintenance
    deleting meanwhile adds its ids)."""
    from pgq.store.group import GroupStore

    store = GroupStore(0, "", topic, "chaos-retention", 1.0, 1, topic_id=tid)
    before = message_ids(engine, topic)
    for _ in range(max_batches):
        try:
            with engine.begin() as conn:
                count = store.expire_messages(conn, tid, retention, batch)
        except Exception as exc:
            if refused is None or not refusal(exc):
                raise
            refused(exc)
            break
        if count < batch:
            break
    return sorted(before - message_ids(engine, topic))


class Drivers:
    """Runs publisher, subscriber and retention threads against `topic`, bounded."""

    def __init__(self, engine: Engine, topic: str, seconds: float, record: Record | None = None):
        self.engine = engine
        self.topic = topic
        self.deadline = time.monotonic() + seconds
        self.record = record or Record()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []

    # -- helpers --------------------------------------------------------------------------

    def _running(self) -> bool:
        return not self.stop_event.is_set() and time.monotonic() < self.deadline

    def _pause(self, seconds: float) -> None:
        self.stop_event.wait(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def _thread(self, name: str, target: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # recorded; wait() raises it
                self.record.errors.append(f"{name}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=guarded, name=f"chaos-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    # -- publishers -----------------------------------------------------------------------

    def publish(
        self, threads: int = 3, tx_threads: int = 1, count: int = 100_000, interval: float = 0.01
    ) -> None:
        """`threads` publisher threads, `tx_threads` of them out-of-order transactions;
        each stops after `count` messages or at the deadline."""
        for i in range(threads):
            name = f"pub{i}"
            how = self._publish_tx if i < tx_threads else self._publish_plain
            self._thread(name, functools.partial(how, name, count, interval))

    def _refused(self, name: str, exc: Exception) -> None:
        """A publish (or a retention batch) the database refused (a deadlock, a statement
        timeout): nothing of it committed, so nothing is recorded; the driver goes on."""
        with self.record.lock:
            self.record.conflicts.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
            self.record.refused_at.append(time.time())
        self._pause(0.1)

    def _publish_plain(self, name: str, count: int, interval: float) -> None:
        sent = 0
        rng = random.Random(name)
        while sent < count and self._running():
            n = min(count - sent, rng.choice([1, 1, 1, 2, 5]))
            began = time.time()
            try:
                if n == 1:
                    ids = [pgq.publish(self.engine, self.topic, {"n": sent, "by": name})]
                else:
                    payloads = [{"n": sent + k, "by": name} for k in range(n)]
                    ids = pgq.publish_many(self.engine, self.topic, payloads)
            except REFUSED as exc:
                self._refused(name, exc)
                continue
            committed = time.time()
            for mid in ids:
                self.record.add(Published(mid, self.topic, name, began, committed, False))
            sent += n
            self._pause(interval * rng.uniform(0.5, 1.5))

    def _publish_tx(self, name: str, count: int, interval: float) -> None:
        """Two transactions at once; the later ids commit first."""
        sent = 0
        rng = random.Random(name)
        while sent < count and self._running():
            began = time.time()
            b: list[int] = []
            try:
                with self.engine.connect() as first, self.engine.connect() as second:
                    tx_a = first.begin()
                    a = pgq.publish_many(first, self.topic, [{"n": sent, "by": name, "tx": "a"}])
                    tx_b = second.begin()
                    n = min(max(count - sent - 1, 0), rng.choice([1, 2, 3]))
                    if n:
                        payloads = [{"n": sent + 1 + k, "by": name} for k in range(n)]
                        b = pgq.publish_many(second, self.topic, payloads)
                    tx_b.commit()
                    b_done = time.time()
                    for mid in b:  # committed: recorded whatever becomes of A
                        self.record.add(Published(mid, self.topic, name, began, b_done, True))
                    time.sleep(rng.uniform(0.0, 0.05))  # A stays open while others commit
                    tx_a.commit()
                    a_done = time.time()
            except REFUSED as exc:
                self._refused(name, exc)
                sent += len(b)
                continue
            for mid in a:
                self.record.add(Published(mid, self.topic, name, began, a_done, True))
            sent += len(a) + len(b)
            self._pause(interval * rng.uniform(0.5, 1.5))

    # -- subscribers ------------------------------------------------------------------------

    def subscribe(
        self,
        count: int = 3,
        interval: float = 2.0,
        prefix: str = "late",
        on_subscribe: Callable[[str], None] | None = None,
        first_after: float | None = None,
    ) -> None:
        """A new group `<prefix><n>` (start earliest) every `interval` seconds, `count` times."""

        def run() -> None:
            self._pause(interval if first_after is None else first_after)
            for n in range(count):
                if not self._running():
                    return
                group = f"{prefix}{n}"
                began = time.time()
                pgq.subscribe(self.engine, group, self.topic, start="earliest")
                returned = time.time()
                present = frozenset(message_ids(self.engine, self.topic))
                self.record.add(Subscription(group, self.topic, began, returned, present))
                if on_subscribe is not None:
                    on_subscribe(group)
                self._pause(interval)

        self._thread("subscriber", run)

    # -- retention ----------------------------------------------------------------------------

    def retain(self, interval: float = 0.5, retention: float = 0.0) -> None:
        """A retention pass every `interval` seconds until the deadline."""

        def run() -> None:
            while self._running():
                began = time.time()
                refused = functools.partial(self._refused, "retention")
                deleted = retention_pass(self.engine, self.topic, retention, refused=refused)
                self.record.add(RetentionPass(began, time.time(), tuple(deleted)))
                self._pause(interval)

        self._thread("retention", run)

    # -- life cycle ------------------------------------------------------------------------------

    def wait(self, timeout: float = 30.0) -> Record:
        """Wait (bounded) for every driver to finish; raise if one failed."""
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        alive = [th.name for th in self.threads if th.is_alive()]
        if alive:
            self.stop_event.set()
            raise AssertionError(f"drivers still running after {timeout:g}s: {alive}")
        if self.record.errors:
            raise AssertionError(f"drivers failed: {self.record.errors}")
        return self.record

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every driver now and wait (bounded) for its thread."""
        self.stop_event.set()
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))

    def __enter__(self) -> Drivers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
