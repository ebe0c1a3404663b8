"""Stateful property tests of delivery against the real database (issue 9).

A hypothesis state machine drives the store the consumer uses (`GroupStore`,
`publish`, `subscribe`), from an empty state per example (its own topics and
groups), in random interleavings of: publishing (one message, a batch, or
inside a transaction left open and committed or rolled back later, so commits
come out of id order and out of xid order); subscribing a group with
`start="earliest"` or `"latest"` (also while an open transaction holds the
topic, so the subscribe waits for it in a thread); claiming as member A or B;
writing outcomes of every kind (done, retry, dead, snooze) with the current
lease, a stale one (from before a release, a sweep or a re-claim, or already
finished) or another member's; releasing and extending leases; expiring leases
(set in the past with SQL) and sweeping them; advancing the frontier; pruning;
and retention with a retention of zero.

A small model in Python says what every step must do, and each step checks its
own result (claim order and count, the leases an outcome, release or extend
applied, rows a sweep, an advance or retention touched). After every step the
real rows are checked against the model and against the invariants of DESIGN
§3 and §4:

- the frontier never moves back and never passes an unresolved row (ready,
  leased, or published by a transaction still open) in (xid, id) order, and it
  goes as far as the xmin read before the advance allows, landing only on a row
  that exists (a done row an ack kept, or a dead row); no done row stays behind
  it;
- an ack deletes the rows it finishes but the batch's last in (xid, id) order,
  which it marks done (schema version 6): per `record` of a group and member,
  the current leases acked;
- a fenced-off outcome (stale lease, other member) never applies: the row is
  byte-for-byte unchanged;
- no outcome applies twice: `attempts` equals the finished attempts the model
  applied, `reclaims` the sweeps;
- every message has a row in every group of its topic that subscribed before
  its transaction committed, or subscribed `earliest` after it, and none in a
  later `latest` group; the only rows missing are the ones an ack deleted or the
  frontier pruned (done, behind it), and no row exists without its message;
- `pgq.status` agrees (committed, counts, totals; done counts the rows acks
  deleted, the kept done rows and the pruned ones).

Bounded for CI by default; `STATEFUL_EXAMPLES` and `STATEFUL_STEPS` scale a
longer run (and then the per-test timeout is lifted), e.g.
`STATEFUL_EXAMPLES=3000 pytest tests/integration/test_stateful_delivery.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers import run_machine, wait_until
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from sqlalchemy import Connection, Engine, Text, cast, func, select, text, tuple_, update

import pgq
from pgq import schema as t
from pgq.records import Claimed, Lease, Outcome
from pgq.store import GroupStore, group_info

EXAMPLES = int(os.environ.get("STATEFUL_EXAMPLES", "0")) or 20
STEPS = int(os.environ.get("STATEFUL_STEPS", "0")) or 40
LONG_RUN = "STATEFUL_EXAMPLES" in os.environ or "STATEFUL_STEPS" in os.environ

STALE_FAILURE_BUG = False
"""Found by this machine and fixed (f19741d): `record_failures` joined a batch's
outcomes to rows by message id, so a stale lease's failure written in the same
batch as the current lease's could be applied in its place. Pinned by
`test_a_stale_failure_beside_the_current_one_does_not_apply`."""

MEMBERS = ("A", "B")
LEASE = 600.0
"""Leases outlive any example: only `expire` ends them."""
MAX_RECLAIMS = 2
LATER = 3600.0
"""A delay no step outlives: rows delayed by it are never claimable in a run."""
XID_MAX = 2**63
MAX_GROUPS = 4
MAX_OPEN = 2
JOIN = 30.0
LOST_LEASE = "lease expired without an outcome too often"

d, m, g, gs = t.delivery, t.message, t.consumer_group, t.group_state
_examples = itertools.count()

SEEN: Counter[str] = Counter()
"""What the run exercised (printed at the end: `pytest -s` or `-rP` shows it)."""


def note(what: str, n: int = 1) -> None:
    """Count something the run exercised (also a hypothesis event)."""
    if n:
        SEEN[what] += n
        event(what)


Pos = tuple[int, int]
"""A place in commit order: (xid, message id)."""


@dataclass
class Row:
    """The model of one delivery row."""

    xid: int
    delayed: bool = False
    state: str = "ready"
    attempts: int = 0
    reclaims: int = 0
    owner: str | None = None
    seq: int = 0
    expired: bool = False
    error_class: str | None = None
    last_error: str | None = None
    refundable_attempts: int = 0
    refundable_reclaims: int = 0

    def view(self) -> tuple[Any, ...]:
        """What the database row must show (see `DeliveryMachine._db_rows`)."""
        return (
            self.xid,
            self.state,
            self.attempts,
            self.reclaims,
            self.owner,
            self.seq,
            self.expired if self.state == "leased" else None,
            self.delayed,
            self.error_class,
            self.last_error,
            self.refundable_attempts,
            self.refundable_reclaims,
        )

    def copy(self) -> Row:
        return Row(**self.__dict__)


@dataclass
class Msg:
    """The model of one committed message."""

    id: int
    topic: str
    xid: int
    payload: Any
    committed_at: int
    delayed: bool
    """Published with a delay while the topic had groups: an earliest backfill keeps it."""


@dataclass
class Group:
    """The model of one subscribed group, with a store per member."""

    name: str
    gid: int
    topic: str
    start: str
    subscribed_at: int
    stores: dict[str, GroupStore]
    frontier: Pos = (0, 0)
    pruned: int = 0
    acked: int = 0
    """Rows its acks deleted (all of a batch's but the last)."""
    reclaimed: int = 0
    released: int = 0


@dataclass
class Pending:
    """A message published in a transaction that is still open."""

    id: int
    topic: str
    payload: Any
    delay: float | None
    gids: tuple[int, ...]
    """The groups it got rows in: those subscribed when it was published."""


@dataclass
class OpenTx:
    """A publishing transaction left open."""

    n: int
    conn: Connection
    xid: int | None = None
    topics: set[str] = field(default_factory=set)
    """Topics it published to: it holds their lock (FOR KEY SHARE) until it ends."""
    pending: list[Pending] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"tx{self.n}"


@dataclass
class WaitingSubscribe:
    """A subscribe blocked (in a thread) behind open transactions that hold its topic."""

    group: str
    topic: str
    start: str
    thread: threading.Thread
    pid: list[int]
    error: list[BaseException]


@dataclass(frozen=True)
class Held:
    """A lease as a member was handed it by a claim."""

    group: str
    member: str
    claimed: Claimed

    @property
    def lease(self) -> Lease:
        return self.claimed.lease

    def key(self) -> tuple[str, str, int]:
        return (self.group, self.member, self.claimed.seq)

    def __repr__(self) -> str:
        return f"Held({self.group}, m{self.claimed.id}, {self.member}, seq={self.claimed.seq})"


@dataclass(frozen=True)
class Spec:
    """An outcome to write."""

    kind: str
    delay: float = 0.0
    error_class: str | None = None
    error: str | None = None

    def __repr__(self) -> str:
        extra = [f"{self.delay:g}s"] if self.delay else []
        extra += [x for x in (self.error_class, self.error and repr(self.error)) if x]
        return f"{self.kind}({', '.join(extra)})"


DELAYS = st.sampled_from((None, None, None, LATER))
RETRY_DELAYS = st.sampled_from((0.0, 0.0, LATER))
STORED_ERROR = {"boom": "boom", "bad\x00byte": "bad\\x00byte", "x" * 2100: "x" * 2000}
"""Error texts a handler may raise, and what the row must keep (no NUL, capped)."""
ERRORS = st.sampled_from(tuple(STORED_ERROR))
SPECS = st.one_of(
    st.just(Spec("done")),
    st.builds(
        Spec,
        kind=st.just("retry"),
        delay=RETRY_DELAYS,
        error_class=st.sampled_from(("message", "systemic")),
        error=ERRORS,
    ),
    st.builds(
        Spec,
        kind=st.just("dead"),
        error_class=st.sampled_from(("permanent", "message", "systemic")),
        error=ERRORS,
    ),
    st.builds(Spec, kind=st.just("snooze"), delay=RETRY_DELAYS),
)
OTHER_MEMBER = st.sampled_from((False, False, False, True))
"""Whether a lease is presented by the member that does not hold it."""


def pow2_floor(limit: int) -> int:
    """The limit `GroupStore.claim` really uses."""
    return 1 << (limit.bit_length() - 1) if limit < 64 else limit


def other(member: str) -> str:
    return MEMBERS[1 - MEMBERS.index(member)]


def applied_row(row: Row, spec: Spec) -> Row:
    """`row` after `spec` applied with its current lease."""
    new = row.copy()
    new.owner, new.expired = None, False
    if spec.kind == "done":
        new.state = "done"
        new.attempts += 1
        return new
    new.state = "dead" if spec.kind == "dead" else "ready"
    new.delayed = spec.delay > 0
    if spec.kind == "snooze":
        new.error_class = None  # waits for the user's time now, not a systemic retry
        return new
    new.attempts += 1
    new.error_class, new.last_error = spec.error_class, STORED_ERROR[spec.error or ""]
    if spec.error_class == "systemic":
        new.refundable_attempts += 1
    else:
        new.refundable_attempts = new.refundable_reclaims = 0
    return new


class DeliveryMachine(RuleBasedStateMachine):
    """Publish, subscribe, claim, outcomes, leases, frontier and retention on real rows.

    Every example starts from nothing: its own two topics (and the groups it
    subscribes to them) in the test's migrated schema, so it shares no row,
    frontier or retention with an earlier example (a schema per example would
    cost ~0.3 s of DDL on a busy 2-core machine, more than its forty steps).
    """

    engine: Engine
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        prefix = f"e{next(_examples)}"
        self.topics = (f"{prefix}.t0", f"{prefix}.t1")
        self.prefix = prefix
        # one session for every step, one in autocommit for the checks' reads (nothing
        # else runs meanwhile): no pool checkout, reset, BEGIN or COMMIT per read
        self.conn = self._session()
        self.reader = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        with self._tx() as conn:
            for topic in self.topics:
                pgq.create_topic(conn, topic)
            found = conn.execute(
                select(t.topic.c.name, t.topic.c.id).where(t.topic.c.name.in_(self.topics))
            )
            self.topic_ids: dict[str, int] = {name: tid for name, tid in found}
        SEEN["examples"] += 1
        self.clock = 0
        self.groups: dict[str, Group] = {}
        self.messages: dict[int, Msg] = {}
        self.rows: dict[tuple[int, int], Row] = {}
        self.pruned: set[tuple[int, int]] = set()
        self.acked: set[tuple[int, int]] = set()
        self.txs: list[OpenTx] = []
        self.waiting: list[WaitingSubscribe] = []
        self.counter = itertools.count()
        self.helds: list[Held] = []  # every lease claimed in this example

    def teardown(self) -> None:
        for tx in self.txs:
            tx.conn.rollback()
            tx.conn.close()
        for sub in self.waiting:
            sub.thread.join(JOIN)
        self.conn.close()
        self.reader.close()

    def _session(self) -> Connection:
        """A connection whose statements fail instead of hanging when a step would
        wait for a lock (no step of this machine should)."""
        conn = self.engine.connect()
        conn.execute(text("SET lock_timeout = '10s'"))
        conn.commit()
        return conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Connection]:
        """A transaction on the steps' connection, committed on exit."""
        with self.conn.begin():
            yield self.conn

    # -- helpers --------------------------------------------------------------

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _payloads(self, n: int) -> list[dict[str, int]]:
        return [{"n": next(self.counter)} for _ in range(n)]

    def _gids(self, topic: str) -> tuple[int, ...]:
        return tuple(grp.gid for grp in self.groups.values() if grp.topic == topic)

    def _waiting_topics(self) -> set[str]:
        return {sub.topic for sub in self.waiting}

    def _free_topics(self) -> list[str]:
        """Topics nothing waits on: publishing there takes the topic lock at once."""
        return [topic for topic in self.topics if topic not in self._waiting_topics()]

    def _publishable(self) -> list[tuple[OpenTx, str]]:
        """(open transaction, topic) pairs that can publish without waiting: the topic
        has no waiting subscribe, or the transaction already holds its lock."""
        waiting = self._waiting_topics()
        return [
            (tx, topic)
            for tx in self.txs
            for topic in self.topics
            if topic not in waiting or topic in tx.topics
        ]

    def _commit_message(
        self,
        mid: int,
        topic: str,
        xid: int,
        payload: Any,
        delay: float | None,
        gids: tuple[int, ...],
    ) -> None:
        self.messages[mid] = Msg(mid, topic, xid, payload, self.clock, bool(delay) and bool(gids))
        for gid in gids:
            self.rows[gid, mid] = Row(xid, delayed=bool(delay))

    def _xids(self, ids: list[int]) -> dict[int, int]:
        rows = self.reader.execute(select(m.c.id, cast(m.c.xid, Text)).where(m.c.id.in_(ids)))
        return {mid: int(xid) for mid, xid in rows}

    def _xmin(self) -> int:
        return int(self.reader.scalar(text("SELECT pg_snapshot_xmin(pg_current_snapshot())::text")))

    def _full_rows(self, conn: Connection, keys: set[tuple[int, int]]) -> dict[Any, Any]:
        """Every column of the delivery rows `keys`, as stored."""
        if not keys:
            return {}
        found = conn.execute(
            select(d).where(tuple_(d.c.group_id, d.c.message_id).in_(sorted(keys)))
        ).all()
        return {(r.group_id, r.message_id): tuple(r) for r in found}

    def _held_by(self, held: Held, presenter: str) -> bool:
        """Whether `presenter` holds the lease `held` right now (per the model)."""
        row = self.rows.get((self.groups[held.group].gid, held.claimed.id))
        return (
            row is not None
            and row.state == "leased"
            and row.owner == presenter
            and row.seq == held.claimed.seq
        )

    def _reach(self, grp: Group, xmin: int) -> Pos:
        """How far the frontier of `grp` may go when the advance's xmin is `xmin`: the
        last row there is (an ack deletes all of its batch but the last) before the
        first unresolved one."""
        reach = grp.frontier
        ahead = sorted(
            ((row.xid, mid), row)
            for (gid, mid), row in self.rows.items()
            if gid == grp.gid and (row.xid, mid) > grp.frontier and row.xid < xmin
        )
        for pos, row in ahead:
            if row.state in ("ready", "leased"):
                break
            reach = pos
        return reach

    def _subscribed(self, name: str, topic: str, start: str) -> None:
        """The model of a subscribe that committed now."""
        with self._tx() as conn:
            gid = group_info(conn, name).id
        stores = {
            member: GroupStore(gid, name, topic, member, LEASE, MAX_RECLAIMS) for member in MEMBERS
        }
        with self._tx() as conn:
            # the members join, as a consumer does before it claims: an ack counts the
            # rows it deletes on its member's row
            for store in stores.values():
                assert store.join(conn, LEASE, takeover=False)
        self.groups[name] = Group(name, gid, topic, start, self._tick(), stores)
        backfilled = [msg for msg in self.messages.values() if msg.topic == topic]
        if start == "earliest" and backfilled:
            # each row carries the xid of the transaction that inserted it: the subscribe's
            ids = [msg.id for msg in backfilled]
            xids = self.reader.scalars(
                select(cast(d.c.xid, Text))
                .where(d.c.group_id == gid, d.c.message_id.in_(ids))
                .distinct()
            ).all()
            assert len(xids) == 1, f"one backfill, several transactions: {xids}"
            for msg in backfilled:
                self.rows[gid, msg.id] = Row(int(xids[0]), delayed=msg.delayed)

    def _settle_subscribes(self) -> None:
        """Finish the waiting subscribes that no open transaction holds back any more."""
        for sub in list(self.waiting):
            if any(sub.topic in tx.topics for tx in self.txs):
                continue
            sub.thread.join(JOIN)
            assert not sub.thread.is_alive(), f"subscribe {sub.group} still waiting"
            self.waiting.remove(sub)
            if sub.error:
                raise sub.error[0]
            self._subscribed(sub.group, sub.topic, sub.start)

    # -- publish and subscribe -------------------------------------------------

    @initialize(
        starts=st.lists(st.sampled_from(("earliest", "latest")), min_size=1, max_size=2),
        n=st.integers(0, 4),
    )
    def start_with_groups(self, starts: list[str], n: int) -> None:
        """Begin with a group or two on the first topic and a few messages (most
        interleavings need them, and thirty random steps rarely build them)."""
        topic = self.topics[0]
        for start in starts:
            name = f"{self.prefix}.g{next(self.counter)}"
            with self._tx() as conn:
                pgq.subscribe(conn, name, topic, start=start)
            self._subscribed(name, topic, start)
        if n:
            self._publish(topic, n, None)

    @precondition(lambda self: self._free_topics())
    @rule(data=st.data(), n=st.integers(1, 3), delay=DELAYS)
    def publish(self, data: st.DataObject, n: int, delay: float | None) -> None:
        """Publish one message or a batch in a transaction of its own."""
        self._publish(data.draw(st.sampled_from(self._free_topics()), label="topic"), n, delay)

    def _publish(self, topic: str, n: int, delay: float | None) -> None:
        payloads = self._payloads(n)
        with self._tx() as conn:
            if n == 1:
                ids = [pgq.publish(conn, topic, payloads[0], delay=delay)]
            else:
                ids = pgq.publish_many(conn, topic, payloads, delay=delay)
        xids = self._xids(ids)
        assert len(set(xids.values())) == 1, f"one batch, several transactions: {xids}"
        gids = self._gids(topic)
        self._tick()
        for mid, payload in zip(ids, payloads, strict=True):
            self._commit_message(mid, topic, xids[mid], payload, delay, gids)

    @precondition(lambda self: len(self.txs) < MAX_OPEN)
    @rule()
    def begin(self) -> None:
        """Open a transaction that will publish later (and may see later subscribes)."""
        conn = self._session()
        conn.begin()
        conn.execute(text("SELECT 1"))
        self.txs.append(OpenTx(next(self.counter), conn))

    @precondition(lambda self: self._publishable())
    @rule(data=st.data(), n=st.integers(1, 3), delay=DELAYS)
    def publish_in_open_tx(self, data: st.DataObject, n: int, delay: float | None) -> None:
        """Publish inside an open transaction (not committed yet)."""
        tx, topic = data.draw(st.sampled_from(self._publishable()), label="tx, topic")
        payloads = self._payloads(n)
        ids = pgq.publish_many(tx.conn, topic, payloads, delay=delay)
        xid = int(tx.conn.execute(text("SELECT pg_current_xact_id()::text")).scalar_one())
        assert tx.xid in (None, xid)
        tx.xid = xid
        tx.topics.add(topic)
        gids = self._gids(topic)
        tx.pending += [
            Pending(mid, topic, p, delay, gids) for mid, p in zip(ids, payloads, strict=True)
        ]

    @precondition(lambda self: self.txs)
    @rule(data=st.data(), commit=st.booleans())
    def end_open_tx(self, data: st.DataObject, commit: bool) -> None:
        """Commit or roll back an open transaction; subscribes waiting for it go on."""
        tx = data.draw(st.sampled_from(self.txs), label="tx")
        self.txs.remove(tx)
        if commit:
            tx.conn.commit()
        else:
            tx.conn.rollback()
        tx.conn.close()
        if commit and tx.pending:
            assert tx.xid is not None
            if min(p.id for p in tx.pending) < max(self.messages, default=0):
                note("commit out of id order")
            self._tick()
            for p in tx.pending:
                self._commit_message(p.id, p.topic, tx.xid, p.payload, p.delay, p.gids)
            note("open transaction committed with messages")
        self._settle_subscribes()

    @precondition(
        lambda self: len(self.groups) + len(self.waiting) < MAX_GROUPS and self._free_topics()
    )
    @rule(data=st.data(), start=st.sampled_from(("earliest", "latest")))
    def subscribe(self, data: st.DataObject, start: str) -> None:
        """Subscribe a new group; behind an open publishing transaction it waits (in a
        thread) until that transaction ends."""
        topic = data.draw(st.sampled_from(self._free_topics()), label="topic")
        name = f"{self.prefix}.g{next(self.counter)}"
        if not any(topic in tx.topics for tx in self.txs):
            with self._tx() as conn:
                pgq.subscribe(conn, name, topic, start=start)
            self._subscribed(name, topic, start)
            return
        pid: list[int] = []
        error: list[BaseException] = []
        engine = self.engine

        def run() -> None:
            try:
                with engine.connect() as conn:
                    pid.append(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
                    conn.commit()
                    with conn.begin():
                        conn.execute(text("SET LOCAL lock_timeout = 0"))
                        pgq.subscribe(conn, name, topic, start=start)
            except BaseException as exc:
                error.append(exc)

        thread = threading.Thread(target=run, name=f"subscribe-{name}", daemon=True)
        thread.start()
        wait_until(
            lambda: not thread.is_alive() or (pid and self._waits_for_lock(pid[0])),
            JOIN,
            f"subscribe {name} to wait for the topic lock",
        )
        if not thread.is_alive():
            # it should have waited: let the invariants judge what it wrote
            note("subscribe did not wait for an open publisher")
            if error:
                raise error[0]
            self._subscribed(name, topic, start)
            return
        note("subscribe waited for an open publisher")
        self.waiting.append(WaitingSubscribe(name, topic, start, thread, pid, error))

    def _waits_for_lock(self, pid: int) -> bool:
        return bool(
            self.reader.scalar(
                text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            )
        )

    # -- claims and leases --------------------------------------------------------

    @precondition(lambda self: self.groups)
    @rule(target=leases, data=st.data(), limit=st.integers(1, 6))
    def claim_as_a(self, data: st.DataObject, limit: int) -> Any:
        """Claim a batch as member A."""
        return self._claim(data, "A", limit)

    @precondition(lambda self: self.groups)
    @rule(target=leases, data=st.data(), limit=st.integers(1, 6))
    def claim_as_b(self, data: st.DataObject, limit: int) -> Any:
        """Claim a batch as member B."""
        return self._claim(data, "B", limit)

    def _claim(self, data: st.DataObject, member: str, limit: int) -> Any:
        """Claim a batch: exactly the earliest available ready rows, fresh lease tokens."""
        grp = data.draw(
            st.sampled_from(sorted(self.groups.values(), key=lambda x: x.gid)), label="group"
        )
        with self._tx() as conn:
            order = list(
                conn.scalars(
                    select(d.c.message_id)
                    .where(d.c.group_id == grp.gid, d.c.state == "ready")
                    .where(d.c.available_at <= func.now())
                    .order_by(d.c.available_at, d.c.message_id)
                )
            )
            claimed = grp.stores[member].claim(conn, limit, 0)
        available = {
            mid
            for (gid, mid), row in self.rows.items()
            if gid == grp.gid and row.state == "ready" and not row.delayed
        }
        assert set(order) == available
        expected = order[: pow2_floor(limit)]
        assert sorted(c.id for c in claimed) == sorted(expected), "claim took the wrong rows"
        held = []
        for c in claimed:
            row = self.rows[grp.gid, c.id]
            assert c.attempts == row.attempts
            assert c.message.attempt == row.attempts + 1
            assert c.message.payload == self.messages[c.id].payload
            assert c.seq != row.seq, "a claim must hand out a new lease token"
            row.state, row.owner, row.seq, row.expired = "leased", member, c.seq, False
            held.append(Held(grp.name, member, c))
        self.helds += held
        note("rows claimed", len(held))
        note("claims that found nothing", not held)
        return multiple(*held)

    @precondition(lambda self: self._current())
    @rule(data=st.data(), twice=st.booleans())
    def record_current(self, data: st.DataObject, twice: bool) -> None:
        """Write outcomes of leases their members hold now (the acker's usual batch)."""
        current = data.draw(
            st.lists(st.sampled_from(self._current()), min_size=1, max_size=4, unique_by=Held.key),
            label="leases",
        )
        specs = data.draw(st.lists(SPECS, min_size=len(current), max_size=len(current)))
        self.record([(h, s, False) for h, s in zip(current, specs, strict=True)], twice)

    @precondition(lambda self: self._current())
    @rule(data=st.data(), twice=st.booleans())
    def ack_current(self, data: st.DataObject, twice: bool) -> None:
        """Ack every lease one member holds now in one group, all successes (a busy
        acker's batch): the ack deletes all of them but the last in (xid, id) order."""
        first = data.draw(st.sampled_from(self._current()), label="lease")
        mine = [h for h in self._current() if (h.group, h.member) == (first.group, first.member)]
        self.record([(h, Spec("done"), False) for h in mine], twice)

    def _current(self) -> list[Held]:
        return [h for h in self.helds if self._held_by(h, h.member)]

    @precondition(lambda self: self.helds)
    @rule(
        batch=st.lists(st.tuples(leases, SPECS, OTHER_MEMBER), min_size=1, max_size=4),
        twice=st.booleans(),
    )
    def record(self, batch: list[tuple[Held, Spec, bool]], twice: bool) -> None:
        """Write a batch of outcomes (one transaction, one `record` per group and
        presenting member, as the acker does) for any leases ever claimed: current,
        stale (released, swept, finished, claimed again) or presented by the other
        member; `twice` sends the whole batch again (a retried write)."""
        parts: dict[tuple[str, str], list[tuple[Held, Spec]]] = {}
        for held, spec, other_member in batch:
            presenter = other(held.member) if other_member else held.member
            parts.setdefault((held.group, presenter), []).append((held, spec))
        # per row: the results allowed (several failures of one lease in one batch:
        # the database applies one of them, which one is not specified)
        allowed: dict[tuple[int, int], list[Row]] = {}
        expected: dict[tuple[str, str], set[Lease]] = {}
        acks: dict[tuple[str, str], set[tuple[int, int]]] = {}
        """Per `record` call, the rows its ack finishes (current leases with a done)."""
        touched: set[tuple[int, int]] = set()
        for (name, presenter), items in parts.items():
            gid = self.groups[name].gid
            expected[name, presenter] = set()
            current = [(h, s) for h, s in items if self._held_by(h, presenter)]
            touched |= {(gid, h.claimed.id) for h, _ in items}
            for held, _ in current:
                key = (gid, held.claimed.id)
                specs = [s for h, s in current if h == held]
                dones = [s for s in specs if s.kind == "done"]
                row = self.rows[key]
                allowed[key] = [applied_row(row, s) for s in (dones[:1] or specs)]
                if dones:
                    acks.setdefault((name, presenter), set()).add(key)
                expected[name, presenter].add(held.lease)
                stale = [
                    s
                    for h, s in items
                    if h.claimed.id == held.claimed.id and h != held and s.kind != "done"
                ]
                if STALE_FAILURE_BUG and stale and not dones:
                    note("known bug: a stale failure outcome beside the current one")
                    allowed[key] += [applied_row(row, s) for s in stale]
        outcomes = {
            key: [Outcome(h.claimed, s.kind, s.delay, s.error_class, s.error) for h, s in items]
            for key, items in parts.items()
        }
        with self._tx() as conn:
            before = self._full_rows(conn, touched)
            applied = {
                key: self.groups[key[0]].stores[key[1]].record(conn, written)
                for key, written in outcomes.items()
            }
            if twice:
                again = {
                    key: self.groups[key[0]].stores[key[1]].record(conn, written)
                    for key, written in outcomes.items()
                }
                assert again == {key: set() for key in outcomes}, "an outcome applied twice"
            after = self._full_rows(conn, touched)
            db = self._db_rows(conn, set(allowed)) if allowed else {}
        assert applied == expected, "outcomes applied are not those of the current leases"
        for key in touched - set(allowed):
            assert after.get(key) == before.get(key), f"a fenced-off outcome changed row {key}"
        applied_n = sum(map(len, expected.values()))
        note("outcomes applied", applied_n)
        note("outcomes fenced off", len(batch) - applied_n)
        note("outcome batches written twice", twice)
        current = set().union(*expected.values())
        for held, _, _ in batch:
            key = (self.groups[held.group].gid, held.claimed.id)
            if key in allowed and held.lease not in current:
                note("stale lease refused while a newer lease on the row applied")
        deleted = self._acked(acks)
        for key in deleted:
            assert key not in db, f"row {key} finished by an ack and not its batch's last: kept"
        for key, options in allowed.items():
            if key in deleted:
                continue
            matches = [row for row in options if row.view() == db[key][:-1]]
            assert matches, f"row {key} is {db[key]}, expected one of {[r.view() for r in options]}"
            self.rows[key] = matches[0]
            note(f"outcome applied, row now {matches[0].state}")
        self._check_status(*{name: self.groups[name] for name, _ in acks}.values())

    def _acked(self, acks: dict[tuple[str, str], set[tuple[int, int]]]) -> set[tuple[int, int]]:
        """The model of the acks of one `record` batch: each ack (a group and presenting
        member) deletes the rows it finishes but its last in (xid, id) order, which
        stays done (`applied_row`) for the frontier to land on; the deleted ones count
        as done in the group. Returns the rows deleted."""
        deleted: set[tuple[int, int]] = set()
        for (name, _), keys in acks.items():
            grp = self.groups[name]
            order = sorted(keys, key=lambda key: (self.rows[key].xid, key[1]))
            for key in order[:-1]:
                del self.rows[key]
            deleted |= set(order[:-1])
            grp.acked += len(order) - 1
            note("rows deleted by an ack", len(order) - 1)
            note("done rows kept by an ack")
        self.acked |= deleted
        return deleted

    @precondition(lambda self: self.helds)
    @rule(batch=st.lists(st.tuples(leases, OTHER_MEMBER), min_size=1, max_size=3))
    def release(self, batch: list[tuple[Held, bool]]) -> None:
        """Release leases (unstarted rows back to ready, uncharged); stale ones are refused."""
        self._fenced_call(batch, "release")

    @precondition(lambda self: self.helds)
    @rule(batch=st.lists(st.tuples(leases, OTHER_MEMBER), min_size=1, max_size=3))
    def extend(self, batch: list[tuple[Held, bool]]) -> None:
        """Extend leases; only those still held are extended."""
        self._fenced_call(batch, "extend")

    def _fenced_call(self, batch: list[tuple[Held, bool]], what: str) -> None:
        parts: dict[tuple[str, str], list[Held]] = {}
        for held, other_member in batch:
            presenter = other(held.member) if other_member else held.member
            parts.setdefault((held.group, presenter), []).append(held)
        expected = {
            key: {h.lease for h in helds if self._held_by(h, key[1])}
            for key, helds in parts.items()
        }
        touched = {(self.groups[h.group].gid, h.claimed.id) for h, _ in batch}
        with self._tx() as conn:
            before = self._full_rows(conn, touched)
            got = {
                key: getattr(self.groups[key[0]].stores[key[1]], what)(
                    conn, [h.lease for h in helds]
                )
                for key, helds in parts.items()
            }
            after = self._full_rows(conn, touched)
        assert got == expected, f"{what} did not act on exactly the current leases"
        changed = set()
        for (name, _), leases in expected.items():
            grp = self.groups[name]
            for lease in leases:
                row = self.rows[grp.gid, lease.id]
                changed.add((grp.gid, lease.id))
                if what == "release":
                    row.state, row.owner, row.expired = "ready", None, False
                    grp.released += 1
                else:
                    row.expired = False
        for key in touched - changed:
            assert after.get(key) == before.get(key), f"a fenced-off {what} changed row {key}"
        applied = sum(map(len, expected.values()))
        note(f"{what}: applied", applied)
        note(f"{what}: fenced off", len(batch) - applied)
        if what == "release":
            self._check_status(*{name: self.groups[name] for name, _ in parts}.values())

    @precondition(lambda self: self.helds)
    @rule(batch=st.lists(leases, min_size=1, max_size=3))
    def expire(self, batch: list[Held]) -> None:
        """Let leases run out: set their expiry in the past (whoever holds them)."""
        with self._tx() as conn:
            for held in batch:
                conn.execute(
                    update(d)
                    .where(d.c.group_id == self.groups[held.group].gid)
                    .where(d.c.message_id == held.claimed.id)
                    .where(d.c.state == "leased", d.c.lease_seq == held.claimed.seq)
                    .values(lease_expires_at=func.now() - text("interval '1 second'"))
                )
        for held in batch:
            row = self.rows.get((self.groups[held.group].gid, held.claimed.id))
            if row is not None and row.state == "leased" and row.seq == held.claimed.seq:
                row.expired = True

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), member=st.sampled_from(MEMBERS))
    def sweep(self, data: st.DataObject, member: str) -> None:
        """Reclaim the rows whose lease expired: back to ready, or dead past max_reclaims."""
        grp = data.draw(
            st.sampled_from(sorted(self.groups.values(), key=lambda x: x.gid)), label="group"
        )
        with self._tx() as conn:
            swept = grp.stores[member].sweep(conn)
        due = [
            row
            for (gid, _), row in self.rows.items()
            if gid == grp.gid and row.state == "leased" and row.expired
        ]
        died = 0
        for row in due:
            row.reclaims += 1
            refundable = row.error_class == "systemic"  # no breaker opens in this model
            if refundable:
                row.refundable_reclaims += 1
            row.owner, row.expired = None, False
            if row.reclaims > MAX_RECLAIMS:
                row.state, row.error_class, row.last_error = "dead", "lease", LOST_LEASE
                if not refundable:  # it died of its own reclaims: no close brings it back
                    row.refundable_attempts = row.refundable_reclaims = 0
                died += 1
            else:
                row.state = "ready"
        grp.reclaimed += len(due)
        assert (swept.reclaimed, swept.dead) == (len(due), died)
        if due:
            note("rows reclaimed by a sweep", len(due))
            note("rows dead past max_reclaims", died)
        self._check_status(grp)

    # -- frontier and retention -------------------------------------------------

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Advance the frontier: exactly as far as the xmin allows, pruning what it passes."""
        grp = data.draw(
            st.sampled_from(sorted(self.groups.values(), key=lambda x: x.gid)), label="group"
        )
        before = self._xmin()
        with self._tx() as conn:
            pruned = grp.stores["A"].advance_frontier(conn)
            cx, cid = conn.execute(
                select(cast(gs.c.committed_xid, Text), gs.c.committed_id).where(
                    gs.c.group_id == grp.gid
                )
            ).one()
        after = self._xmin()
        assert pruned is not None, "nobody else holds the group row"
        old, new = grp.frontier, (int(cx), cid or 0)
        low, high = self._reach(grp, before), self._reach(grp, after)
        assert old <= low <= new <= high, (
            f"frontier {old} -> {new}; the xmin allowed {low} (before) .. {high} (after)"
        )
        if new != old:
            assert self.rows[grp.gid, new[1]].xid == new[0], "the frontier names its row's xid"
            note("frontier moved")
        elif self._reach(grp, XID_MAX) != old:
            note("frontier held by the xmin")
        gone = {
            key
            for key, row in self.rows.items()
            if key[0] == grp.gid and row.state == "done" and old < (row.xid, key[1]) <= new
        }
        assert pruned == len(gone), (
            f"pruned {pruned}, expected the done rows passed: {sorted(gone)}"
        )
        note("done rows pruned by the advance", len(gone))
        for key in gone:
            del self.rows[key]
        self.pruned |= gone
        grp.pruned += len(gone)
        grp.frontier = new
        self._check_status(grp)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def prune(self, data: st.DataObject) -> None:
        """Prune done rows behind the frontier (none should be left: the advance pruned them)."""
        grp = data.draw(
            st.sampled_from(sorted(self.groups.values(), key=lambda x: x.gid)), label="group"
        )
        with self._tx() as conn:
            pruned = grp.stores["B"].prune_behind(conn)
        assert pruned == 0

    @precondition(lambda self: self._free_topics())
    @rule(data=st.data())
    def retention(self, data: st.DataObject) -> None:
        """Retention with a retention of zero: deletes exactly the messages no group holds."""
        topic = data.draw(st.sampled_from(self._free_topics()), label="topic")
        store = GroupStore(0, "-", topic, "retention", LEASE, MAX_RECLAIMS)
        with self._tx() as conn:
            deleted = store.expire_messages(conn, self.topic_ids[topic], 0.0)
        held = {mid for (_, mid) in self.rows}
        due = {mid for mid, msg in self.messages.items() if msg.topic == topic and mid not in held}
        assert deleted == len(due), f"retention deleted {deleted}, expected {sorted(due)}"
        for mid in due:
            del self.messages[mid]
        if due:
            note("messages deleted by retention", len(due))

    # -- invariants -------------------------------------------------------------

    def _db_rows(
        self, conn: Connection, keys: set[tuple[int, int]] | None = None
    ) -> dict[tuple[int, int], tuple[Any, ...]]:
        """Delivery rows of this example as `Row.view()` shows them, plus whether
        the message is there (last)."""
        later = func.now() + text("interval '1800 seconds'")
        query = select(
            d.c.group_id,
            d.c.message_id,
            cast(d.c.xid, Text),
            d.c.state,
            d.c.attempts,
            d.c.reclaims,
            d.c.lease_owner,
            d.c.lease_seq,
            d.c.lease_expires_at < func.now(),
            d.c.available_at > later,
            d.c.error_class,
            d.c.last_error,
            d.c.refundable_attempts,
            d.c.refundable_reclaims,
            m.c.id.is_not(None),
        ).select_from(d.outerjoin(m, m.c.id == d.c.message_id))
        if keys is not None:
            query = query.where(tuple_(d.c.group_id, d.c.message_id).in_(sorted(keys)))
        else:
            query = query.where(d.c.group_id.in_([grp.gid for grp in self.groups.values()]))
        return {(r[0], r[1]): (int(r[2]), *r[3:]) for r in conn.execute(query)}

    @invariant()
    def database_agrees(self) -> None:
        """After every step, against the rows: the model, coverage, frontier."""
        SEEN["checks"] += 1
        gids = [grp.gid for grp in self.groups.values()]
        topic_ids = list(self.topic_ids.values())
        rows = self._db_rows(self.reader)
        messages = {
            mid: (tid, int(xid), payload)
            for mid, tid, xid, payload in self.reader.execute(
                select(m.c.id, m.c.topic_id, cast(m.c.xid, Text), m.c.payload).where(
                    m.c.topic_id.in_(topic_ids)
                )
            )
        }
        groups = {
            name: (gid, (int(cx), cid or 0))
            for gid, name, cx, cid in self.reader.execute(
                select(g.c.id, g.c.name, cast(gs.c.committed_xid, Text), gs.c.committed_id)
                .join(gs, gs.c.group_id == g.c.id)
                .where(g.c.topic_id.in_(topic_ids))
            )
        }
        orphans = sorted(key for key, row in rows.items() if not row[-1])
        assert not orphans, f"delivery rows without their message: {orphans}"
        assert groups == {name: (grp.gid, grp.frontier) for name, grp in self.groups.items()}, (
            "groups or frontiers differ from the model"
        )
        assert messages == {
            mid: (self.topic_ids[msg.topic], msg.xid, msg.payload)
            for mid, msg in self.messages.items()
        }, "messages differ from the model"
        db = {key: row[:-1] for key, row in rows.items()}
        model = {key: row.view() for key, row in self.rows.items()}
        assert db.keys() == model.keys(), (
            f"rows missing: {sorted(model.keys() - db.keys())},"
            f" unexpected: {sorted(db.keys() - model.keys())}"
        )
        wrong = {key: (db[key], model[key]) for key in db if db[key] != model[key]}
        assert not wrong, f"rows (database, model): {wrong}"
        assert len(gids) == len(set(gids))
        self._check_coverage()
        self._check_frontier()

    def _check_coverage(self) -> None:
        """A row in every group subscribed before the message committed, or `earliest`
        after it; none in a `latest` group that came later. Only rows an ack deleted
        and pruned rows are gone."""
        for msg in self.messages.values():
            for grp in self.groups.values():
                if grp.topic != msg.topic:
                    continue
                key = (grp.gid, msg.id)
                present = key in self.rows or key in self.pruned or key in self.acked
                due = grp.subscribed_at < msg.committed_at or grp.start == "earliest"
                assert present == due, (
                    f"message {msg.id} (committed at step {msg.committed_at}) in group"
                    f" {grp.name} ({grp.start}, subscribed at {grp.subscribed_at}): row {present}"
                )

    def _check_frontier(self) -> None:
        """The frontier (equal to the model's, which never moves back) passes no
        unresolved row and no message of a transaction still open, and leaves no done
        row behind it."""
        for grp in self.groups.values():
            here = grp.frontier
            for (gid, mid), row in self.rows.items():
                if gid == grp.gid and (row.xid, mid) <= here:
                    assert row.state == "dead", (
                        f"{grp.name}: frontier {here} is past message {mid} ({row.state})"
                    )
            for tx in self.txs:
                for p in tx.pending:
                    if grp.gid in p.gids:
                        assert tx.xid is not None and here < (tx.xid, p.id), (
                            f"{grp.name}: frontier {here} passed open {tx} ({tx.xid}, {p.id})"
                        )

    def _check_status(self, *groups: Group) -> None:
        """`pgq status` of `groups` shows the frontier, counts and totals of the model."""
        for grp in groups:
            status = pgq.status(self.engine, grp.name)
            mine = [row for (gid, _), row in self.rows.items() if gid == grp.gid]
            states = Counter(row.state for row in mine)
            systemic = sum(1 for r in mine if r.state == "dead" and r.error_class == "systemic")
            assert status["committed"] == (grp.frontier[1] or None)
            assert status["counts"] == {
                "ready": states["ready"],
                "leased": states["leased"],
                "done": states["done"] + grp.pruned + grp.acked,
                "dead": states["dead"],
                "dead_systemic": systemic,
            }
            assert status["lag"] == states["ready"] + states["leased"]
            assert status["totals"] == {
                "reclaimed": grp.reclaimed,
                "released": grp.released,
                "refunded": 0,
            }


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.timeout(0 if LONG_RUN else 120)
def test_delivery_state_machine(pg_dsn: str, schema: str) -> None:
    """Random interleavings of publish, subscribe, claims, outcomes, leases, frontier
    and retention keep every invariant of the rows (see the module docstring)."""
    run_machine(DeliveryMachine, pg_dsn, schema, SETTINGS, SEEN)


def test_a_stale_failure_beside_the_current_one_does_not_apply(orders: Engine) -> None:
    """Found by the machine above (shrunk by hand): member A loses its lease (here a
    release; a sweep does the same), claims the message again, and one batch holds
    a failure of each lease, the stale one first. Only the current lease's outcome
    may apply; the stale one was applied to the current lease instead."""
    mid = pgq.publish(orders, "orders", {"n": 1})
    info = group_info(orders, "billing")
    store = GroupStore(info.id, "billing", "orders", "A", LEASE, MAX_RECLAIMS)
    with orders.begin() as conn:
        [old] = store.claim(conn, 1, 0)
        assert store.release(conn, [old.lease]) == {old.lease}
    with orders.begin() as conn:
        [new] = store.claim(conn, 1, 0)
        applied = store.record(
            conn,
            [
                Outcome(old, "dead", 0.0, "permanent", "stale attempt"),
                Outcome(new, "retry", 0.0, "message", "current attempt"),
            ],
        )
    assert applied == {new.lease}
    with orders.connect() as conn:
        row = conn.execute(
            select(d.c.state, d.c.attempts, d.c.error_class, d.c.last_error).where(
                d.c.group_id == info.id, d.c.message_id == mid
            )
        ).one()
    assert tuple(row) == ("ready", 1, "message", "current attempt")
