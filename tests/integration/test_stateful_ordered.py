"""Stateful property test of an ordered group (DESIGN §7, decision 0044; issue 22 §2).

A hypothesis state machine drives the store of an ordered group (`GroupStore` with
`ordered=True`, members A, B and C) against the real database, from an empty topic
per example, in random interleavings of: publishing messages of a few keys (and
none) one by one or as a batch of one key, now or delayed, in a transaction of their
own or in one left open and committed or rolled back later (so commits come out of
xid order); claims by the three members; outcomes (done, retry now or later, dead,
snooze now or later; message or systemic failures, the systemic ones charged to the
outage); leases run out and swept (reclaimed, or dead past `max_reclaims`);
releases; requeues of dead rows (`pgq requeue`), some of a key whose later row runs;
the breaker opening, alone or tripped by a running row's systemic failure (charged
dead rows then hold their keys: a close will refund them), probes, the close and its
reconciliation; and a drain by one member until it finds nothing.

The database is the state: before a claim the machine reads the group's rows, the
breaker and the xmin, and works out which rows the rule lets a claim take (the
model, `Snapshot.eligible`). Checked:

- a claim returns exactly the first rows (by available time, then id) the rule
  allows, as many as its limit: only heads of their keys, never two of one key, and
  nothing claimable withheld (liveness); a probe takes a row the rule allows, and a
  probe that finds nothing leaves no row the rule allows it;
- after every step, per key at most one leased row; a leased keyed row has no
  earlier row of its key, in (xid, id) order, that is ready, leased or dead with a
  refund pending, unless that row became so after the lease was taken (a requeue or
  an outage made an earlier row of the key unresolved while a later one ran: the
  rule lets the running one finish, decision 0044);
- a drain leaves no row the rule allows a claim to take.

Checked that it fails: with the claim's "no row of its key leased" test removed it
finds a requeued earlier row started beside the later one; with a pending refund no
longer holding the key, a probe that took the later row (both at the default bound,
~35 s on PostgreSQL 15, ~50 s on Citus).

Bounded for CI; `STATEFUL_EXAMPLES` and `STATEFUL_STEPS` scale a longer run.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
from helpers import run_machine
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sqlalchemy import Connection, Text, cast, func, literal_column, select, update
from test_stateful_delivery import LATER, SEEN, note, pow2_floor
from test_stateful_delivery import SETTINGS as DELIVERY_SETTINGS

import pgq
from pgq import schema as t
from pgq.records import Claimed, Outcome, OutcomeKind
from pgq.store import GroupStore, group_info
from pgq.store import requeue as requeue_rows

EXAMPLES = int(os.environ.get("STATEFUL_EXAMPLES", "0")) or 40
STEPS = int(os.environ.get("STATEFUL_STEPS", "0")) or 40
LONG_RUN = "STATEFUL_EXAMPLES" in os.environ or "STATEFUL_STEPS" in os.environ

MEMBERS = ("A", "B", "C")
KEYS = ("a", "a", "b", None)
"""Few keys, so rows of a key meet often."""
LEASE = 600.0
"""Leases outlive any example: only `expire` ends them."""
MAX_RECLAIMS = 2
MAX_REFUNDS = 2
MAX_OPEN = 2

SPECS = (
    (OutcomeKind.DONE, 0.0, None),
    (OutcomeKind.DONE, 0.0, None),
    (OutcomeKind.RETRY, 0.0, "message"),
    (OutcomeKind.RETRY, LATER, "message"),
    (OutcomeKind.RETRY, 0.0, "systemic"),
    (OutcomeKind.DEAD, 0.0, "permanent"),
    (OutcomeKind.DEAD, 0.0, "systemic"),
    (OutcomeKind.SNOOZE, 0.0, None),
    (OutcomeKind.SNOOZE, LATER, None),
)
"""The outcomes a handler's attempt may end in: (kind, delay, error class). A
systemic failure is charged to the outage (refunded by a close)."""

d, br = t.delivery, t.breaker
_examples = itertools.count()


@dataclass(frozen=True)
class Row:
    """One delivery row of the group as the machine reads it."""

    id: int
    key: str | None
    xid: int
    state: str
    due: bool
    available_at: Any
    charged: bool
    error_epoch: int | None
    refunds: int
    seq: int
    error_class: str | None

    @property
    def pos(self) -> tuple[int, int]:
        return (self.xid, self.id)


@dataclass(frozen=True)
class Snapshot:
    """The group's rows, its breaker and the server's xmin, read at one moment."""

    rows: dict[int, Row]
    open: bool
    owed: tuple[int, int] | None
    xmin: int

    def pending(self, row: Row, cap: bool = False) -> bool:
        """A dead row a close will refund: it holds its key (0044)."""
        if row.state != "dead" or not row.charged or row.error_epoch is None:
            return False
        if cap and row.refunds >= MAX_REFUNDS:
            return False
        owed = self.owed is not None and self.owed[0] <= row.error_epoch < self.owed[1]
        return self.open or owed

    def unresolved(self, row: Row, cap: bool = False) -> bool:
        return row.state in ("ready", "leased") or self.pending(row, cap)

    def key_free(self, row: Row, cap: bool = False) -> bool:
        """The rule of `pgq.sql.claim.key_free`, in Python."""
        if row.key is None:
            return True
        of_key = [r for r in self.rows.values() if r.key == row.key and r.id != row.id]
        return (
            row.xid < self.xmin
            and not any(r.state == "leased" for r in of_key)
            and not any(r.pos < row.pos and self.unresolved(r, cap) for r in of_key)
        )

    def owed_now(self, row: Row) -> bool:
        """A row the close still owes a refund: a claim skips it until reconciled."""
        if self.owed is None or not row.charged or row.error_epoch is None:
            return False
        return self.owed[0] <= row.error_epoch < self.owed[1]

    def probe_candidate(self, row: Row) -> bool:
        """A row a probe may take (`pgq.sql.breaker.PROBE_KINDS`) that the rule allows."""
        ready = row.state == "ready" and (row.due or row.error_class == "systemic")
        dead = row.state == "dead" and row.charged and row.refunds < MAX_REFUNDS
        return (ready or dead) and self.key_free(row, cap=True)

    def eligible(self) -> list[Row]:
        """What a worker's claim may take, in the order it takes it."""
        if self.open:
            return []
        rows = [
            r
            for r in self.rows.values()
            if r.state == "ready" and r.due and not self.owed_now(r) and self.key_free(r)
        ]
        return sorted(rows, key=lambda r: (r.available_at, r.id))


@dataclass
class OpenTx:
    conn: Connection
    ids: list[int]


class OrderedMachine(RuleBasedStateMachine):
    """Publish, claim, outcomes, leases, requeue and the breaker of one ordered group."""

    engine: Any

    def __init__(self) -> None:
        super().__init__()
        prefix = f"o{next(_examples)}"
        self.topic, self.group = f"{prefix}.t", f"{prefix}.g"
        self.conn = self.engine.connect()
        self.reader = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        with self.conn.begin():
            pgq.create_topic(self.conn, self.topic)
            pgq.subscribe(self.conn, self.group, self.topic, ordered=True)
            info = group_info(self.conn, self.group)
        self.gid = info.id
        self.stores = {
            name: GroupStore(
                *(info.id, self.group, self.topic, name, LEASE, MAX_RECLAIMS),
                topic_id=info.topic_id,
                ordered=True,
            )
            for name in MEMBERS
        }
        with self.conn.begin():
            for store in self.stores.values():
                assert store.join(self.conn, LEASE, takeover=False)
        self.held: dict[int, tuple[str, Claimed]] = {}
        """The lease each message was last claimed under, and by whom."""
        self.txs: list[OpenTx] = []
        self.step = 0
        self.claimed_at: dict[int, tuple[int, int]] = {}
        """Message id -> (lease token, step it was claimed at)."""
        self.unresolved_since: dict[int, int] = {}
        """Message id -> the step it last became unresolved."""
        self.counter = itertools.count()
        SEEN["examples"] += 1

    def teardown(self) -> None:
        for tx in self.txs:
            tx.conn.rollback()
            tx.conn.close()
        self.conn.close()
        self.reader.close()

    # -- reading ---------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        conn = self.reader
        xmin = int(conn.scalar(select(func.pg_snapshot_xmin(func.pg_current_snapshot()))))
        found = conn.execute(
            select(
                d.c.message_id,
                d.c.key,
                cast(d.c.xid, Text),
                d.c.state,
                d.c.available_at <= func.now(),
                d.c.available_at,
                d.c.refundable_attempts + d.c.refundable_reclaims > literal_column("0"),
                d.c.error_epoch,
                d.c.refunds,
                d.c.lease_seq,
                d.c.error_class,
            ).where(d.c.group_id == self.gid)
        )
        rows = {r[0]: Row(r[0], r[1], int(r[2]), *r[3:]) for r in found}
        state, lo, hi = conn.execute(
            select(br.c.state, br.c.reconcile_from_epoch, br.c.reconcile_epoch).where(
                br.c.group_id == self.gid
            )
        ).one()
        owed = None if hi is None else (lo, hi)
        return Snapshot(rows, state == "OPEN", owed, xmin)

    def epoch(self) -> int:
        return int(self.reader.scalar(select(br.c.epoch).where(br.c.group_id == self.gid)))

    def current(self) -> list[int]:
        """Messages whose last claim's lease is still held (per the rows)."""
        leased = self.reader.execute(
            select(d.c.message_id, d.c.lease_seq).where(
                d.c.group_id == self.gid, d.c.state == "leased"
            )
        )
        return sorted(
            mid for mid, seq in leased if mid in self.held and self.held[mid][1].seq == seq
        )

    # -- publish ---------------------------------------------------------------

    def _publish(
        self, conn: Connection, keys: list[str | None], batch: bool, delay: Any
    ) -> list[int]:
        payloads = [{"n": next(self.counter)} for _ in keys]
        if batch:
            return pgq.publish_many(conn, self.topic, payloads, key=keys[0], delay=delay)
        return [
            pgq.publish(conn, self.topic, p, key=k, delay=delay)
            for p, k in zip(payloads, keys, strict=True)
        ]

    @initialize(keys=st.lists(st.sampled_from(KEYS), min_size=2, max_size=6))
    def start(self, keys: list[str | None]) -> None:
        with self.conn.begin():
            self._publish(self.conn, keys, False, None)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        batch=st.booleans(),
        delay=st.sampled_from((None, None, None, LATER)),
    )
    def publish(self, keys: list[str | None], batch: bool, delay: Any) -> None:
        """Publish in a transaction of its own (a batch: one key for all)."""
        with self.conn.begin():
            self._publish(self.conn, keys, batch, delay)
        note("published", len(keys))

    @precondition(lambda self: len(self.txs) < MAX_OPEN)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2), batch=st.booleans())
    def publish_open(self, keys: list[str | None], batch: bool) -> None:
        """Publish in a transaction left open (an xid below later publishes)."""
        conn = self.engine.connect()
        conn.begin()
        self.txs.append(OpenTx(conn, self._publish(conn, keys, batch, None)))

    @precondition(lambda self: self.txs)
    @rule(data=st.data(), commit=st.booleans())
    def end_open(self, data: st.DataObject, commit: bool) -> None:
        """Commit or roll back an open publish, in any order."""
        tx = data.draw(st.sampled_from(self.txs), label="tx")
        self.txs.remove(tx)
        (tx.conn.commit if commit else tx.conn.rollback)()
        tx.conn.close()
        note("open publish committed" if commit else "open publish rolled back")

    # -- claims ----------------------------------------------------------------

    @rule(member=st.sampled_from(MEMBERS), limit=st.integers(1, 6))
    def claim(self, member: str, limit: int) -> None:
        """A claim takes exactly the first rows the rule allows (only heads, none withheld)."""
        before = self.snapshot()
        with self.conn.begin():
            claimed = self.stores[member].claim(self.conn, limit, self.epoch())
        after = self.snapshot()
        ids = [c.id for c in claimed]
        assert len(set(ids)) == len(ids)
        # the claim's own xid moves the xmin on; another session's transaction ending
        # (a shared server) may too, between the two reads: then the claim may have
        # seen either
        first = [r.id for r in before.eligible()]
        later = [r.id for r in replace(before, xmin=after.xmin).eligible()]
        if first == later:
            expected = first[: pow2_floor(limit)]
            assert sorted(ids) == sorted(expected), f"claimed {ids}, the rule allows {expected}"
        else:
            assert set(ids) <= set(later), f"claimed {ids}, the rule allows {later}"
            assert ids or not first, "a claim withheld a row it may take"
        keys = [before.rows[i].key for i in ids if before.rows[i].key is not None]
        assert len(keys) == len(set(keys)), f"one claim, two rows of a key: {ids}"
        for c in claimed:
            self.held[c.id] = (member, c)
        note("rows claimed", len(ids))
        note("claims that found nothing", not ids)

    @precondition(lambda self: self.current())
    @rule(data=st.data(), spec=st.sampled_from(SPECS))
    def outcome(self, data: st.DataObject, spec: tuple[OutcomeKind, float, str | None]) -> None:
        """Write an outcome of a lease its member holds."""
        mid = data.draw(st.sampled_from(self.current()), label="message")
        member, claimed = self.held[mid]
        kind, delay, error_class = spec
        outcome = Outcome(claimed, kind, delay, error_class, error_class and "boom")
        with self.conn.begin():
            applied = self.stores[member].record(self.conn, [outcome])
        assert applied == {claimed.lease}
        note(" ".join(("outcome", kind.value, "later" * bool(delay), error_class or "")))

    @precondition(lambda self: self.current())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        mid = data.draw(st.sampled_from(self.current()), label="message")
        member, claimed = self.held[mid]
        with self.conn.begin():
            assert self.stores[member].release(self.conn, [claimed.lease]) == {claimed.lease}
        note("released")

    @precondition(lambda self: self.current())
    @rule(data=st.data(), member=st.sampled_from(MEMBERS))
    def expire_and_sweep(self, data: st.DataObject, member: str) -> None:
        """A lease runs out (its holder paused or died) and a sweep reclaims it."""
        mid = data.draw(st.sampled_from(self.current()), label="message")
        with self.conn.begin():
            self.conn.execute(
                update(d)
                .where(d.c.group_id == self.gid, d.c.message_id == mid)
                .values(lease_expires_at=func.now() - literal_column("interval '1 second'"))
            )
        with self.conn.begin():
            swept = self.stores[member].sweep(self.conn)
        assert swept.reclaimed == 1
        note("reclaimed, dead" if swept.dead else "reclaimed")

    def dead(self) -> bool:
        return any(r.state == "dead" for r in self.snapshot().rows.values())

    @precondition(lambda self: self.dead())
    @rule(data=st.data(), overtake=st.booleans())
    def requeue(self, data: st.DataObject, overtake: bool) -> None:
        """`pgq requeue` of a dead row; with `overtake`, one whose key has a later row
        running when there is one (the requeued row must wait for it)."""
        snap = self.snapshot()
        dead = [r for r in snap.rows.values() if r.state == "dead"]
        behind = [
            r
            for r in dead
            if any(
                o.key == r.key and o.state == "leased" and o.pos > r.pos
                for o in snap.rows.values()
                if r.key is not None
            )
        ]
        pick = behind if overtake and behind else dead
        mid = data.draw(st.sampled_from(sorted(r.id for r in pick)), label="dead")
        assert requeue_rows(self.engine, self.group, [mid], reason="model").count == 1
        note("requeued behind a running row" if pick is behind else "requeued")

    # -- the breaker -----------------------------------------------------------

    @precondition(lambda self: not self.snapshot().open)
    @rule(now=st.sampled_from((False, False, True)))
    def open_breaker(self, now: bool) -> None:
        """An outage: the breaker opens (its charged dead rows now hold their keys).
        One time in three (an open breaker holds every claim back)."""
        if now:
            self._open()

    @precondition(lambda self: self.current() and not self.snapshot().open)
    @rule(data=st.data(), dies=st.booleans(), probe=st.booleans())
    def trip(self, data: st.DataObject, dies: bool, probe: bool) -> None:
        """The failure that trips the breaker: a running row fails systemic (dies of it,
        its attempts spent, or waits for a retry), then the breaker opens; with `probe`
        the prober probes at once."""
        mid = data.draw(st.sampled_from(self.current()), label="message")
        member, claimed = self.held[mid]
        kind = OutcomeKind.DEAD if dies else OutcomeKind.RETRY
        with self.conn.begin():
            outcome = Outcome(claimed, kind, 0.0, "systemic", "down")
            assert self.stores[member].record(self.conn, [outcome]) == {claimed.lease}
        self._open()
        note("tripped")
        if probe:
            self.probe()

    def _open(self) -> None:
        with self.conn.begin():
            self.conn.execute(
                update(br)
                .where(br.c.group_id == self.gid)
                .values(state="OPEN", epoch=br.c.epoch + 1, next_probe_at=func.now())
            )
        note("opened")

    @precondition(lambda self: self.snapshot().open)
    @rule()
    def probe(self) -> None:
        """A probe takes a row the rule allows, or finds none that it allows."""
        before = self.snapshot()
        store = self.stores["A"]
        with self.conn.begin():
            got = store.claim_probe(self.conn, self.epoch(), MAX_REFUNDS, hold=0.0)
        if got is None:
            left = [r.id for r in before.rows.values() if before.probe_candidate(r)]
            assert not left, f"no probe, yet the rule allows one of {left}"
            note("probe found nothing")
            return
        row = before.rows[got.id]
        assert before.key_free(row, cap=True), f"probe {got.id} is not the head of its key"
        self.held[got.id] = ("A", got)
        note("probed")

    @precondition(lambda self: self.snapshot().open)
    @rule(reconcile=st.booleans())
    def close(self, reconcile: bool) -> None:
        """The close (a probe succeeded); its reconciliation now or at a later step."""
        with self.conn.begin():
            assert self.stores["A"].close(self.conn, self.epoch()) is not None
        note("closed")
        if reconcile:
            self.reconcile()

    @precondition(lambda self: self.snapshot().owed is not None)
    @rule()
    def reconcile(self) -> None:
        """Refund what the close owes (dead and systemic rows ready again)."""
        owed = self.snapshot().owed
        assert owed is not None
        with self.conn.begin():
            n = self.stores["B"].reconcile_batch(self.conn, owed[1], owed[0], MAX_REFUNDS, 100)
            assert self.stores["B"].reconcile_done(self.conn, owed[1], owed[0], MAX_REFUNDS)
        note("refunded", n)

    @precondition(lambda self: not self.snapshot().open)
    @rule(now=st.sampled_from((False, False, True)))
    def drain(self, now: bool) -> None:
        """Member C claims and finishes until it finds nothing: nothing the rule allows
        is left (what stays is behind a lease, a retry, a delay or an open publish).
        One time in three (it empties the group)."""
        if not now:
            return
        for _ in range(50):
            with self.conn.begin():
                claimed = self.stores["C"].claim(self.conn, 8, self.epoch())
                if not claimed:
                    break
                outcomes = [Outcome(c, OutcomeKind.DONE) for c in claimed]
                assert self.stores["C"].record(self.conn, outcomes) == {c.lease for c in claimed}
            note("drained", len(claimed))
        assert not self.snapshot().eligible(), "a drain left a row the rule allows"

    # -- invariants ------------------------------------------------------------

    @invariant()
    def one_per_key_in_order(self) -> None:
        self.step += 1
        SEEN["steps"] += 1
        snap = self.snapshot()
        for row in snap.rows.values():
            if row.state == "leased" and self.claimed_at.get(row.id, (None,))[0] != row.seq:
                self.claimed_at[row.id] = (row.seq, self.step)
            if snap.unresolved(row):
                self.unresolved_since.setdefault(row.id, self.step)
            else:
                self.unresolved_since.pop(row.id, None)
        held_back = [
            r
            for r in snap.rows.values()
            if r.state == "ready"
            and any(snap.pending(e) and e.key == r.key for e in snap.rows.values())
        ]
        note("a dead row a close will refund holds a ready row back", bool(held_back))
        leased = [r for r in snap.rows.values() if r.state == "leased" and r.key is not None]
        keys = Counter(r.key for r in leased)
        assert all(n == 1 for n in keys.values()), f"two rows of a key leased: {keys}"
        for run in leased:
            taken = self.claimed_at[run.id][1]
            for r in snap.rows.values():
                if r.key == run.key and r.pos < run.pos and snap.unresolved(r):
                    assert self.unresolved_since[r.id] > taken, (
                        f"{run.id} runs while earlier {r.id} of key {run.key} is {r.state}"
                    )
                    note("an earlier row of a running key made unresolved again")


SETTINGS = settings(DELIVERY_SETTINGS, max_examples=EXAMPLES, stateful_step_count=STEPS)


@pytest.mark.slow
@pytest.mark.timeout(0 if LONG_RUN else 120)
def test_ordered_state_machine(pg_dsn: str, schema: str) -> None:
    """Random interleavings of publishes, claims, outcomes, leases, requeues and outages
    keep one message per key at a time, in order, and leave nothing claimable behind."""
    SEEN.clear()  # counted by the delivery machine's `note` too, if it ran first
    run_machine(OrderedMachine, pg_dsn, schema, SETTINGS, SEEN)
