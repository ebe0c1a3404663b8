"""Stateful property tests of the circuit breaker against the real database (issue 10).

A hypothesis state machine plays up to three members of one group (A, B, C) at
the level the consumer's threads work: every step runs the statements of
`GroupStore` that a fetcher, acker, heartbeat, sweeper or prober runs, on the
member's own session lock (its liveness) and probe lock (the election), in
random interleavings of: publishing (now, or scheduled for later; some messages
poison: their handler fails them for themselves alone); starting, crashing
(its sessions gone), pausing (its heartbeat stale), resuming and stopping
members; heartbeats (which open the group when the quorum of live tripped
members is there); local trips and local probes; claims, outcomes of every
class (done, systemic, message, permanent, snooze), releases, lease expiry and
sweeps; prober elections and the prober's loop one step at a time (probe,
close, reconciliation in batches of `RECONCILE_LIMIT` rows); probe outcomes
(success, systemic, inconclusive) while the dependency is down, and decided by
the message while it is healthy; the prober's lock session dying at any step
(another member is then elected and finishes); the probe time and the user's
scheduled times coming (set in the past with SQL: nothing sleeps); and the
`--until-empty` drain check.

A model in Python predicts every step exactly (rows, breaker row, history,
totals, member rows, liveness, election results, the probe row chosen), and
after every step the database must agree. Beside that agreement, the
invariants of issue 10 (DESIGN §5–§6) are checked as statements of their own:

- a row is refunded at most once per close (a refund by the successful probe
  counts for the close it makes); the rows a reconciliation batch refunds are
  rows the close owes: rows carrying refundable charges (attempts failed as
  systemic, reclaims while a breaker was open) made within the close's window
  of epochs, dead or ready, under the refund cap;
- no row owed a refund is claimed before the refund (a claim skips it);
- no row the user scheduled (`delay=`, `RetryLater`) is claimed, probed or made
  due by a refund before its time;
- with the dependency healthy and a healthy probe candidate there, probes of
  poison rows are bounded (they rotate), and a healthy probe closes the group;
- a lone member never opens the group (`min_members` 2), so nothing is refunded
  without a quorum open and a successful probe;
- the persisted state is only CLOSED or OPEN;
- `--until-empty` (the fetcher's drain check) never reports empty while rows it
  could run are ready or a reconciliation is owed.

Bounded for CI by default; `STATEFUL_BREAKER_EXAMPLES` and
`STATEFUL_BREAKER_STEPS` scale a longer run (and then the per-test timeout is
lifted), e.g. `STATEFUL_BREAKER_EXAMPLES=2000 pytest tests/integration/test_stateful_breaker.py`.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pytest
from helpers import run_machine
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from sqlalchemy import Connection, Engine, Text, cast, func, select, text, update

import pgq
from pgq import schema as t
from pgq.breaker import probe_delay
from pgq.records import Claimed, DrainState, Lease, Outcome
from pgq.sql.members import member_live
from pgq.store import GroupStore, LostLock, SessionLock, group_info, member_lock, probe_lock
from pgq.store.members import lock_holders

EXAMPLES = int(os.environ.get("STATEFUL_BREAKER_EXAMPLES", "0")) or 20
STEPS = int(os.environ.get("STATEFUL_BREAKER_STEPS", "0")) or 200
LONG_RUN = "STATEFUL_BREAKER_EXAMPLES" in os.environ or "STATEFUL_BREAKER_STEPS" in os.environ

MEMBERS = ("A", "B", "C")
LEASE = 600.0
"""Leases outlive any example: only `expire` ends them."""
TTL = 600.0
"""`breaker.member_ttl`: heartbeats never go stale by themselves; `pause` makes them."""
LATER = 3600.0
"""A delay no step outlives: only `time_passes` brings such a time."""
MAX_ATTEMPTS = 2
MAX_RECLAIMS = 1
MAX_REFUNDS = 2
MIN_MEMBERS = 2
QUORUM = 0.5
PROBER_TURNS = 3
PROBE_INTERVAL = 1000.0
PROBE_INTERVAL_MAX = 4000.0
"""Probe backoff never runs out by itself: only `probe_time_comes` brings the next probe."""
HOLD = LEASE + 1.0
"""How long the slot a probe reserves lasts unless renewed (the prober passes `member_ttl`)."""
RECONCILE_LIMIT = 2
"""Rows per reconciliation batch: a reconciliation spans several steps."""
POISON_PROBES_PER_ROW = MAX_ATTEMPTS + MAX_RECLAIMS + 2
"""How often one poison row may be probed, while a healthy candidate waits, before
the group closes (see `_claim_probe`)."""

d, mb, br, hist, gs = t.delivery, t.member, t.breaker, t.breaker_history, t.group_state
_examples = itertools.count()

SEEN: Counter[str] = Counter()
"""What the run exercised (printed at the end: `pytest -s` or `-rP` shows it)."""


def note(what: str, n: int = 1) -> None:
    """Count something the run exercised (also a hypothesis event)."""
    if n:
        SEEN[what] += n
        event(what)


def pow2_floor(limit: int) -> int:
    """The limit `GroupStore.claim` really uses."""
    return 1 << (limit.bit_length() - 1) if limit < 64 else limit


@dataclass
class Row:
    """The model of one delivery row."""

    poison: str | None = None
    """The handler fails this message for itself alone, with this error class."""
    state: str = "ready"
    """`deleted`: an ack finished it and deleted the row (all of a batch but its last)."""
    attempts: int = 0
    reclaims: int = 0
    ra: int = 0
    """Refundable attempts."""
    rr: int = 0
    """Refundable reclaims."""
    refunds: int = 0
    error_class: str | None = None
    error_epoch: int | None = None
    future: bool = False
    """`available_at` is later than now."""
    scheduled: bool = False
    """The time the user asked for (`delay=`, `RetryLater`) has not come."""
    owner: str | None = None
    seq: int = 0
    expired: bool = False
    probe_of: int | None = None
    """Leased as the group probe of this OPEN epoch."""

    def view(self) -> tuple[Any, ...]:
        """What the database row must show (see `BreakerMachine._db_rows`)."""
        leased = self.state == "leased"
        return (
            self.state,
            self.attempts,
            self.reclaims,
            self.ra,
            self.rr,
            self.refunds,
            self.error_class,
            self.error_epoch,
            self.future,
            self.owner,
            self.seq,
            self.expired if leased else None,
        )

    @property
    def charged(self) -> bool:
        return self.ra + self.rr > 0


@dataclass
class Brk:
    """The model of the group's breaker row."""

    state: str = "CLOSED"
    epoch: int = 0
    probe_due: bool = True
    failures: int = 0
    reconcile_epoch: int | None = None
    reconcile_from: int | None = None

    def view(self) -> tuple[Any, ...]:
        return (
            self.state,
            self.epoch,
            self.probe_due,
            self.failures,
            self.reconcile_epoch,
            self.reconcile_from,
        )


@dataclass(frozen=True)
class Held:
    """A lease as a member process was handed it."""

    member: str
    life: int
    """The process (incarnation of the member) that claimed it."""
    claimed: Claimed
    group_probe: bool = False

    @property
    def lease(self) -> Lease:
        return self.claimed.lease

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def __repr__(self) -> str:
        kind = "group probe" if self.group_probe else "local probe" if self.claimed.probe else ""
        return f"Held(m{self.claimed.id}, {self.member}#{self.life}, seq={self.claimed.seq}{kind})"


@dataclass
class Proc:
    """One member name and the process that runs under it (if any)."""

    name: str
    store: GroupStore
    session: SessionLock
    """The member's liveness lock (DESIGN §6.2)."""
    probe: SessionLock
    """The group's probe lock as this member tries it."""
    life: int = 0
    """Processes started under this name so far."""
    running: bool = False
    stale: bool = False
    """Its heartbeat is older than the TTL (a paused process)."""
    left: bool = False
    joined: bool = False
    """The member row exists."""
    local: str = "closed"
    tripped: int | None = None
    """The gate's `tripped_epoch`."""
    reported: tuple[str, int | None] = ("closed", None)
    """The member row: local breaker and tripped epoch."""
    view: tuple[str, int] = ("CLOSED", 0)
    """The gate's view of the group (state, epoch)."""
    leading: bool = False
    """Its prober believes it holds the probe lock."""
    holds: bool = False
    """Its probe lock session really holds the lock."""
    turns: int = 0
    sitting_out: bool = False
    probing: Held | None = None
    probe_view: tuple[int, int] = (0, 0)
    """The (epoch, probe failures) its prober read before the probe in flight."""

    @property
    def live(self) -> bool:
        return self.joined and self.running and not self.stale and not self.left

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def see(self, state: str, epoch: int) -> None:
        """`Gate.see_group`: the view never goes back."""
        if epoch >= self.view[1]:
            self.view = (state, epoch)

    def __repr__(self) -> str:
        return f"Proc({self.name}#{self.life})"


RESULTS = st.sampled_from(
    ("done", "systemic", "systemic", "systemic", "message", "permanent", "snooze")
)
"""What an attempt's handler did while the dependency is down (or flaky)."""
PROBE_RESULTS = st.sampled_from(
    ("done", "done", "systemic", "systemic", "message", "permanent", "snooze")
)
"""What a probe's handler did while the dependency is down: success (it is back, or
flaky) a little more often than an attempt's, so that outages end."""
DELAYS = st.sampled_from((0.0, LATER))
PICK = st.integers(0, 63)


class BreakerMachine(RuleBasedStateMachine):
    """Members, claims, outcomes, trips, opens, probes, closes and refunds on real rows.

    Every example starts from nothing: its own topic and group (so its own probe
    lock and member locks) in the test's migrated schema.
    """

    engine: Engine

    def __init__(self) -> None:
        super().__init__()
        prefix = f"b{next(_examples)}"
        self.topic, self.group = f"{prefix}.t", f"{prefix}.g"
        self.conn = self.engine.connect()
        self.conn.execute(text("SET lock_timeout = '10s'"))
        self.conn.commit()
        self.reader = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        with self._tx() as conn:
            pgq.create_topic(conn, self.topic)
            pgq.subscribe(conn, self.group, self.topic, start="earliest")
            self.gid = group_info(conn, self.group).id
        self.procs = {
            name: Proc(
                name,
                GroupStore(self.gid, self.group, self.topic, name, LEASE, MAX_RECLAIMS),
                member_lock(self.engine, self.gid, name),
                probe_lock(self.engine, self.group),
            )
            for name in MEMBERS
        }
        SEEN["examples"] += 1
        self.brk = Brk()
        self.history: list[list[Any]] = []
        self.rows: dict[int, Row] = {}
        self.totals: Counter[str] = Counter()
        self.helds: list[Held] = []
        """Leases member processes still hold (no outcome written, not released)."""
        self.refunded_for: set[tuple[int, int]] = set()
        """(message id, close epoch) of every refund made."""
        self.healthy = False
        """The dependency works: probes and attempts succeed unless the message is poison."""
        self.poison_probes = 0
        """Probes of poison rows while healthy with a healthy candidate there, this epoch."""

    def teardown(self) -> None:
        SEEN["examples that opened the group"] += any(h[1] == "OPEN" for h in self.history)
        SEEN["examples that closed the group"] += any(h[1] == "CLOSED" for h in self.history)
        SEEN["examples that refunded rows"] += bool(self.refunded_for)
        for proc in self.procs.values():
            proc.probe.release()
            proc.session.release()
        self.conn.close()
        self.reader.close()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        """A transaction on the steps' connection (a role's one transaction)."""
        with self.conn.begin():
            yield self.conn

    def _set_rows(self, mids: list[int], **values: Any) -> None:
        """Write `values` into the group's rows of the messages `mids`."""
        with self._tx() as conn:
            conn.execute(
                update(d).where(d.c.group_id == self.gid, d.c.message_id.in_(mids)).values(**values)
            )

    # -- model helpers ------------------------------------------------------------

    def _running(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.running]

    def _pick(self, data: st.DataObject, items: list[Any], label: str) -> Any:
        """One of `items` (None if there is none), drawn so that the draw has the same
        shape whatever the items: a reconciliation batch refunds rows in the order the
        server finds them, so the model's lists may differ between runs of one example."""
        index = data.draw(PICK, label=f"{label} index")
        if not items:
            return None
        item = items[index % len(items)]
        data.draw(st.just(item), label=label)  # names it in a failing example
        return item

    def _pick_some(self, data: st.DataObject, items: list[Any], most: int, label: str) -> list[Any]:
        """Up to `most` distinct ones of `items` (see `_pick`)."""
        picked = [
            self._pick(data, items, label)
            for _ in range(data.draw(st.integers(1, most), label=f"{label} count"))
        ]
        return [x for i, x in enumerate(picked) if x is not None and x not in picked[:i]]

    def _writable(self, proc: Proc | None = None) -> list[Held]:
        """Leases whose process still runs and may write their outcome (not group probes)."""
        return [
            h
            for h in self.helds
            if not h.group_probe
            and self.procs[h.member].running
            and self.procs[h.member].life == h.life
            and (proc is None or h.member == proc.name)
        ]

    def _current(self, held: Held) -> bool:
        """The member still holds `held` in the database (per the model)."""
        row = self.rows[held.claimed.id]
        return row.state == "leased" and row.owner == held.member and row.seq == held.claimed.seq

    def _owed(self, row: Row) -> bool:
        """The reconciliation still owed refunds this row (DESIGN §6.5): it carries
        refundable charges made within the owed window of epochs, it is dead or
        ready, and it is under the refund cap."""
        b = self.brk
        return (
            b.reconcile_epoch is not None
            and b.reconcile_from is not None
            and row.state in ("dead", "ready")
            and row.charged
            and row.error_epoch is not None
            and b.reconcile_from <= row.error_epoch < b.reconcile_epoch
            and row.refunds < MAX_REFUNDS
        )

    def _in_window(self, row: Row) -> bool:
        """Charged within the owed window, whatever the refund cap: a claim may skip it."""
        b = self.brk
        return (
            b.reconcile_epoch is not None
            and b.reconcile_from is not None
            and row.charged
            and row.error_epoch is not None
            and b.reconcile_from <= row.error_epoch < b.reconcile_epoch
        )

    def _probe_in_flight(self) -> bool:
        """A probe of this OPEN epoch is leased, unexpired, by a live member."""
        b = self.brk
        return b.state == "OPEN" and any(
            row.state == "leased"
            and row.probe_of == b.epoch
            and not row.expired
            and row.owner is not None
            and self.procs[row.owner].live
            for row in self.rows.values()
        )

    def _refund(self, mid: int, close_epoch: int) -> None:
        """Note a refund of row `mid` for the close `close_epoch`: at most one per close."""
        assert (mid, close_epoch) not in self.refunded_for, (
            f"row {mid} refunded twice for the close at epoch {close_epoch}"
        )
        self.refunded_for.add((mid, close_epoch))
        self.poison_probes = 0  # a refund gives poison rows their attempts back

    def _history_add(self, epoch: int, n: int) -> None:
        for entry in self.history:
            if entry[0] == epoch:
                entry[2] += n

    def _open(self) -> int:
        b = self.brk
        b.state, b.epoch, b.probe_due, b.failures = "OPEN", b.epoch + 1, True, 0
        self.history.append([b.epoch, "OPEN", 0])
        self.poison_probes = 0
        return b.epoch

    def _close(self, epoch: int, refunded: int) -> int | None:
        """The model of `close`: CLOSED at epoch + 1 if still OPEN at `epoch`."""
        b = self.brk
        if b.state != "OPEN" or b.epoch != epoch:
            return None
        if b.reconcile_epoch is None or b.reconcile_from is None:
            b.reconcile_from = epoch - 1
        else:
            b.reconcile_from = min(b.reconcile_from, epoch - 1)
        b.state, b.epoch, b.probe_due, b.failures = "CLOSED", epoch + 1, True, 0
        b.reconcile_epoch = b.epoch
        self.history.append([b.epoch, "CLOSED", refunded])
        self.poison_probes = 0
        return b.epoch

    def _outcome(self, held: Held, result: str, delay: float) -> Outcome:
        """What the member's handling makes of `result` (see `pgq.consumer.handling`)."""
        c = held.claimed
        if result == "done":
            return Outcome(c, "done")
        if result == "snooze":
            return Outcome(c, "snooze", delay=delay)
        error = f"{result} failure"
        if result == "permanent" or c.attempts + 1 >= MAX_ATTEMPTS:
            return Outcome(c, "dead", error_class=result, error=error)
        return Outcome(c, "retry", delay=delay, error_class=result, error=error)

    def _applied(self, held: Held, out: Outcome) -> None:
        """The model of an outcome written with the current lease (acker statements)."""
        row = self.rows[held.claimed.id]
        row.owner, row.expired, row.probe_of = None, False, None
        if out.kind == "done":
            row.state = "done"
            row.attempts += 1
            return
        row.state = "dead" if out.kind == "dead" else "ready"
        row.future = out.delay > 0
        if out.kind == "snooze":
            row.scheduled = out.delay > 0
            row.error_class = None
            return
        row.scheduled = False
        row.attempts += 1
        row.error_class, row.error_epoch = out.error_class, held.claimed.epoch
        if out.error_class == "systemic":
            row.ra += 1
        else:
            row.ra = row.rr = 0

    def _observe_local_probe(self, proc: Proc, out: Outcome) -> None:
        """`Gate.observe` of a local probe's outcome, then the heartbeat it pokes."""
        if out.kind == "done":
            proc.local = "closed"
            note("local breaker closed by its probe")
        elif out.error_class == "systemic":
            proc.tripped = proc.view[1]
        self._beat(proc)

    def _sweep(self, proc: Proc) -> None:
        """Run the sweep as `proc` and model it: expired leases back to ready (or dead
        past max_reclaims), charged when a breaker was open or the last failure
        systemic; a reclaim that was not refundable and kills the row drops its charges."""
        with self._tx() as conn:
            swept = proc.store.sweep(conn)
        b = self.brk
        reclaimed = died = 0
        for row in self.rows.values():
            if row.state != "leased" or not row.expired:
                continue
            assert row.owner is not None
            holder = self.procs[row.owner]
            refundable = (
                b.state == "OPEN" or holder.reported[0] == "open" or row.error_class == "systemic"
            )
            dies = row.reclaims + 1 > MAX_RECLAIMS
            row.reclaims += 1
            if dies and not refundable:
                row.ra = row.rr = 0
            elif refundable:
                row.rr += 1
            if dies or refundable:
                row.error_epoch = b.epoch
            if dies:
                row.state, row.error_class = "dead", "lease"
                died += 1
            else:
                row.state = "ready"
            row.owner, row.expired, row.probe_of = None, False, None
            reclaimed += 1
            note("reclaim charged" if refundable else "reclaim not charged")
        self.totals["reclaimed"] += reclaimed
        assert (swept.reclaimed, swept.dead) == (reclaimed, died)
        note("rows reclaimed by a sweep", reclaimed)
        note("rows dead past max_reclaims", died)

    def _live_count(self) -> int:
        return sum(1 for p in self.procs.values() if p.live)

    def _quorum_opens(self) -> bool:
        live = [p for p in self.procs.values() if p.live]
        tripped = [p for p in live if p.reported == ("open", self.brk.epoch)]
        needed = max(MIN_MEMBERS, math.ceil(Fraction(str(QUORUM)) * len(live)))
        return len(tripped) >= needed and len(tripped) > 0

    # -- database helpers ---------------------------------------------------------

    def _breaker_view(self, conn: Connection, proc: Proc) -> Any:
        """The prober's read of the breaker row; the model must agree, the gate sees it."""
        view = proc.store.breaker(conn)
        got = (
            view.state,
            view.epoch,
            view.probe_due,
            view.probe_failures,
            view.reconcile_epoch,
            view.reconcile_from,
        )
        assert got == self.brk.view(), f"breaker {got}, model {self.brk.view()}"
        proc.see(view.state, view.epoch)
        return view

    # -- members ------------------------------------------------------------------

    @initialize(
        data=st.data(),
        n_members=st.sampled_from((1, 2, 3, 3)),
        n=st.integers(0, 8),
        delay=st.sampled_from((0, 2)),
        outage=st.booleans(),
    )
    def start_with_members(
        self, data: st.DataObject, n_members: int, n: int, delay: int, outage: bool
    ) -> None:
        """Begin with one to three members and a few messages (some scheduled for
        later), and half the time with an outage under way (random steps build one
        only now and then)."""
        for name in MEMBERS[:n_members]:
            self._start(self.procs[name])
        if n:
            self._publish(n, None, None)
        if delay:
            self._publish(delay, LATER, None)
        if outage:
            self.outage(data, everyone=True)

    @rule(
        data=st.data(),
        action=st.sampled_from(("start", "start", "crash", "stop", "pause", "lose_lock")),
    )
    def lifecycle(self, data: st.DataObject, action: str) -> None:
        """A member process starts (a new member, or a restart after a crash or stop),
        crashes, stops gracefully, is paused (its heartbeat goes stale), or its
        prober's lock session dies."""
        if action == "start":
            procs = [p for p in self.procs.values() if not p.running]
        elif action == "stop":
            procs = [p for p in self._running() if p.probing is None]
        elif action == "pause":
            procs = [p for p in self._running() if not p.stale]
        elif action == "lose_lock":
            procs = [p for p in self._running() if p.holds]
        else:
            procs = self._running()
        proc = self._pick(data, procs, "member")
        if proc is not None:
            getattr(self, f"_{action}")(proc)

    def _start(self, proc: Proc) -> None:
        assert proc.session.acquire(), f"{proc}: its session lock is held by nobody"
        with self._tx() as conn:
            assert proc.store.join(conn, TTL, takeover=True)
        note("member restarted" if proc.life else "member started")
        # the old process's leases are nobody's now: they wait for their expiry
        self.helds = [h for h in self.helds if h.member != proc.name]
        proc.life += 1
        proc.running, proc.stale, proc.left, proc.joined = True, False, False, True
        proc.local, proc.tripped, proc.reported = "closed", None, ("closed", None)
        proc.view = ("CLOSED", 0)
        proc.leading = proc.holds = proc.sitting_out = False
        proc.turns, proc.probing = 0, None
        self._beat(proc)

    def _crash(self, proc: Proc) -> None:
        """Kill a member process: its sessions end (both locks free at once); its
        leases stay until they expire; its member row stays, not live."""
        proc.probe.release()
        proc.session.release()
        if proc.holds:
            note("prober crashed")
            if self.brk.reconcile_epoch is not None:
                note("prober crashed with a reconciliation owed")
        if proc.probing:
            note("prober crashed mid-probe")
        proc.running = proc.leading = proc.holds = False
        proc.probing = None
        self.helds = [h for h in self.helds if h.member != proc.name]
        self.poison_probes = 0

    def _stop(self, proc: Proc) -> None:
        """Stop a member gracefully: release its leases, leave the group, unlock."""
        mine = self._writable(proc)
        if mine:
            self._release(proc, mine)
        with self._tx() as conn:
            proc.store.leave(conn)
        proc.probe.release()
        proc.session.release()
        proc.running = proc.leading = proc.holds = False
        proc.left = True
        proc.reported = ("closed", proc.reported[1])
        note("member stopped")

    def _pause(self, proc: Proc) -> None:
        """The member's heartbeat goes stale (the process is paused; it runs on later)."""
        with self._tx() as conn:
            conn.execute(
                update(mb)
                .where(mb.c.group_id == self.gid, mb.c.name == proc.name)
                .values(last_seen=func.now() - text(f"interval '{TTL + 1:g} seconds'"))
            )
        proc.stale = True
        self.poison_probes = 0

    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        """A member's heartbeat (it opens the group when the quorum is there)."""
        proc = self._pick(data, self._running(), "member")
        if proc is not None:
            self._beat(proc)

    def _beat(self, proc: Proc) -> None:
        """`Heartbeat.beat`: record liveness and the local breaker, open on quorum."""
        local, tripped = proc.local, proc.tripped
        with self._tx() as conn:
            seen = proc.store.heartbeat(conn, local, tripped)
            assert seen == (self.brk.state, self.brk.epoch), f"heartbeat saw {seen}"
            proc.stale, proc.reported = False, (local, tripped)
            view = proc.store.breaker(conn)
            opened = None
            tries = view.state == "CLOSED" and local == "open" and tripped == view.epoch
            if tries:
                opened = proc.store.open_on_quorum(
                    conn, view.epoch, ttl=TTL, min_members=MIN_MEMBERS, quorum=QUORUM
                )
        if tries:
            expected = self._open() if self._quorum_opens() else None
            assert opened == expected, f"open on quorum gave {opened}, expected {expected}"
            if opened is not None:
                tripped_live = [p for p in self.procs.values() if p.live and p.local == "open"]
                assert len(tripped_live) >= MIN_MEMBERS, "a lone member opened the group"
                note(f"group opened by a quorum of {len(tripped_live)}")
            else:
                note(f"quorum not reached ({self._live_count()} live)")
        proc.see(*(("OPEN", opened) if opened is not None else (view.state, view.epoch)))

    @rule(data=st.data(), everyone=st.booleans())
    def local_trip(self, data: st.DataObject, everyone: bool) -> None:
        """A member's local breaker trips (its window filled with systemic failures),
        or (`everyone`) every running member's does, as in a real outage: tripped
        under the epoch its gate knows, each heartbeats at once."""
        closed = [p for p in self._running() if p.local == "closed"]
        one = self._pick(data, closed, "member")
        for proc in closed if everyone else [one] if one else []:
            proc.local, proc.tripped = "open", proc.view[1]
            note("local trip")
            self._beat(proc)

    @rule(data=st.data(), everyone=st.booleans())
    def outage(self, data: st.DataObject, everyone: bool) -> None:
        """The dependency goes down under traffic: each running member claims a few
        rows, they fail as systemic, and (some of) the members trip."""
        self._dependency(False)
        for name in MEMBERS:
            proc = self.procs[name]
            limit = data.draw(st.integers(1, 2), label=f"{name} claims")
            delay = data.draw(DELAYS, label=f"{name} retries after")
            if proc.running and proc.local == "closed":
                batch = self._claim(proc, limit)
                self._write(proc, batch, [self._outcome(h, "systemic", delay) for h in batch])
        self.local_trip(data, everyone)

    # -- publish and time ---------------------------------------------------------

    @rule(
        n=st.integers(1, 3),
        delay=st.sampled_from((None, None, None, LATER)),
        poison=st.sampled_from((None, None, None, None, "systemic", "message")),
    )
    def publish(self, n: int, delay: float | None, poison: str | None) -> None:
        """Publish messages, now or scheduled for later; poison ones fail for themselves."""
        self._publish(n, delay, poison)

    def _publish(self, n: int, delay: float | None, poison: str | None) -> None:
        with self._tx() as conn:
            ids = pgq.publish_many(conn, self.topic, [{"poison": poison}] * n, delay=delay)
        for mid in ids:
            self.rows[mid] = Row(poison=poison, future=bool(delay), scheduled=bool(delay))

    @rule(data=st.data())
    def time_passes(self, data: st.DataObject) -> None:
        """The time some rows wait for (a retry, a snooze, a delay) comes: their
        `available_at` is set to one fixed moment long past (a time that depends on
        when the step ran would order the claims differently from run to run)."""
        later = [mid for mid, r in self.rows.items() if r.future]
        mids = self._pick_some(data, later, 3, "row")
        if not mids:
            return
        self._set_rows(mids, available_at=text("timestamptz '2000-01-01 00:00:00+00'"))
        for mid in mids:
            self.rows[mid].future = self.rows[mid].scheduled = False

    @rule(in_flight=st.booleans())
    def probe_time_comes(self, in_flight: bool) -> None:
        """The next probe time comes: the backoff after a probe, or (`in_flight`) the
        slot a probe in flight reserved, which its prober stopped renewing (paused,
        its connection cut; a killed prober's probe is no longer in flight at all)."""
        if self.brk.state != "OPEN" or self.brk.probe_due:
            return
        if self._probe_in_flight() and not in_flight:
            return
        with self._tx() as conn:
            conn.execute(
                update(br)
                .where(br.c.group_id == self.gid)
                .values(next_probe_at=func.now() - text("interval '1 second'"))
            )
        self.brk.probe_due = True
        if self._probe_in_flight():
            note("a probe's reserved slot ran out while it was in flight")
            self.poison_probes = 0

    @rule()
    def recover(self) -> None:
        """The dependency comes back: outcomes are decided by the message (success
        unless poison) until the next outage."""
        self._dependency(True)

    def _dependency(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.poison_probes = 0
            note("dependency back" if healthy else "dependency down")

    # -- claims and outcomes --------------------------------------------------------

    @rule(data=st.data(), limit=st.integers(1, 4))
    def claim(self, data: st.DataObject, limit: int) -> None:
        """Claim as a member whose gate allows it (it has not seen the group OPEN): a
        batch, or its local probe (one row) while its local breaker is open. The group
        may be OPEN already: the claim statement is the last gate."""
        proc = self._pick(data, self._running(), "member")
        if proc is not None:
            self._claim(proc, limit)

    def _claim(self, proc: Proc, limit: int) -> list[Held]:
        if proc.view[0] == "OPEN":
            return []  # its gate claims nothing while it knows the group is OPEN
        probe = proc.local == "open"
        if probe:
            if any(h.claimed.probe for h in self._writable(proc)):
                return []  # one local probe at a time
            limit = 1
        with self._tx() as conn:
            order = list(
                conn.scalars(
                    select(d.c.message_id)
                    .where(d.c.group_id == self.gid, d.c.state == "ready")
                    .where(d.c.available_at <= func.now())
                    .order_by(d.c.available_at, d.c.message_id)
                )
            )
            claimed = proc.store.claim(conn, limit, proc.view[1], probe)
        due = {mid for mid, r in self.rows.items() if r.state == "ready" and not r.future}
        assert set(order) == due, f"ready rows due now {sorted(order)}, model {sorted(due)}"
        got = [c.id for c in claimed]
        for mid in got:
            row = self.rows[mid]
            assert not self._owed(row), f"claimed row {mid} before the refund it is owed"
            assert not row.scheduled, f"claimed row {mid} before the time the user asked for"
        if self.brk.state == "OPEN":
            assert not got, "a claim took rows while the group is OPEN"
            note("claim refused: group OPEN")
            return []
        # the claim takes the earliest rows it may: never one owed a refund, and the
        # ones charged within the owed window past the refund cap it may skip too
        skippable = {mid for mid in order if self._in_window(self.rows[mid])}
        rest = [mid for mid in order if not self._owed(self.rows[mid])]
        want, taken = pow2_floor(limit), set(got)
        expected = []
        for mid in rest:
            if len(expected) == want:
                break
            if mid in taken or mid not in skippable:
                expected.append(mid)
        assert sorted(got) == sorted(expected), (
            f"claim took {got}, expected {expected} (skippable {sorted(skippable)})"
        )
        if any(self._owed(self.rows[mid]) for mid in order):
            note("claim during reconciliation skipped owed rows")
        helds = []
        for c in claimed:
            row = self.rows[c.id]
            assert c.attempts == row.attempts
            row.state, row.owner, row.seq, row.expired = "leased", proc.name, c.seq, False
            # filed under the epoch the claim saw, never the older one a gate may
            # still show (docs/defects.md)
            assert c.epoch == max(proc.view[1], self.brk.epoch), f"claim epoch {c.epoch}"
            helds.append(Held(proc.name, proc.life, c))
        self.helds += helds
        note("local probe claimed" if probe and claimed else "rows claimed", len(claimed))
        return helds

    @rule(data=st.data())
    def outcomes(self, data: st.DataObject) -> None:
        """Workers finish attempts of one member and its acker writes their outcomes in
        one batch (an outcome whose lease was lost meanwhile is refused)."""
        first = self._pick(data, self._writable(), "lease")
        mine = self._writable(first and self.procs[first.member])
        batch = self._pick_some(data, [first, *mine] if first else [], 4, "lease")
        drawn = [(data.draw(RESULTS, label="result"), data.draw(DELAYS)) for _ in range(4)]
        if first is None:
            return
        outs = []
        for held, (result, delay) in zip(batch, drawn, strict=False):
            if self.healthy:
                result = self.rows[held.claimed.id].poison or "done"
            outs.append(self._outcome(held, result, delay))
        self._write(self.procs[first.member], batch, outs)

    def _write(self, proc: Proc, batch: list[Held], outs: list[Outcome]) -> None:
        """The acker's batch: outcomes of `proc`'s leases `batch`, in one transaction.
        Its ack deletes the rows it finishes but the last in (xid, id) order, which
        stays done."""
        with self._tx() as conn:
            positions = {
                mid: (int(xid), mid)
                for mid, xid in conn.execute(
                    select(d.c.message_id, cast(d.c.xid, Text)).where(
                        d.c.group_id == self.gid,
                        d.c.message_id.in_([h.claimed.id for h in batch]),
                    )
                )
            }
            applied = proc.store.record(conn, outs)
        current = [self._current(held) for held in batch]
        finished = sorted(
            {
                held.claimed.id
                for held, out, cur in zip(batch, outs, current, strict=True)
                if cur and out.kind == "done"
            },
            key=lambda mid: positions[mid],
        )
        assert applied == {h.lease for h, cur in zip(batch, current, strict=True) if cur}
        for held, out, cur in zip(batch, outs, current, strict=True):
            self.helds.remove(held)
            if cur:
                self._applied(held, out)
                note(f"outcome {out.kind} {out.error_class or ''}".strip())
            else:
                note("late outcome refused")
            if held.claimed.probe:
                self._observe_local_probe(proc, out)
        for mid in finished[:-1]:
            self.rows[mid].state = "deleted"
        note("rows deleted by an ack", len(finished[:-1]))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A member hands unstarted rows back (its gate closed, or it stops)."""
        first = self._pick(data, self._writable(), "lease")
        mine = self._writable(first and self.procs[first.member])
        batch = self._pick_some(data, [first, *mine] if first else [], 3, "lease")
        if first is not None:
            self._release(self.procs[first.member], batch)

    def _release(self, proc: Proc, helds: list[Held]) -> None:
        with self._tx() as conn:
            released = proc.store.release(conn, [h.claimed.lease for h in helds])
        current = [h for h in helds if self._current(h)]
        assert released == {h.claimed.lease for h in current}
        for h in current:
            row = self.rows[h.claimed.id]
            row.state, row.owner, row.expired, row.probe_of = "ready", None, False, None
        self.totals["released"] += len(current)
        for h in helds:
            self.helds.remove(h)
        note("rows released", len(current))

    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """Leases run out (their holders paused, crashed, or slow)."""
        leased = [mid for mid, r in self.rows.items() if r.state == "leased"]
        mids = self._pick_some(data, leased, 3, "row")
        if not mids:
            return
        self._set_rows(mids, lease_expires_at=func.now() - text("interval '1 second'"))
        for mid in mids:
            if self.rows[mid].probe_of is not None:
                self.poison_probes = 0
            self.rows[mid].expired = True

    @rule(data=st.data(), drain=st.booleans())
    def sweep(self, data: st.DataObject, drain: bool) -> None:
        """A member's maintenance reclaims expired leases; with `drain`, an idle member
        runs the `--until-empty` drain check (`Fetcher._drained`) after it."""
        proc = self._pick(data, self._running(), "member")
        if proc is None:
            return
        self._sweep(proc)
        if drain and not self._writable(proc) and proc.probing is None:
            self._drain_check(proc)

    # -- the prober -------------------------------------------------------------------

    @rule(data=st.data(), turns=st.integers(1, 3))
    def prober(self, data: st.DataObject, turns: int) -> None:
        """A member's prober thread takes one to three turns; each is an election;
        elected, one turn of its loop; or, with its probe in flight, the probe's
        handler returning (a result drawn while the dependency is down) and the
        outcome written."""
        proc = self._pick(data, self._running(), "member")
        results = [(data.draw(PROBE_RESULTS), data.draw(DELAYS)) for _ in range(turns)]
        for result, delay in results:
            if proc is None or not proc.running:
                return
            if proc.probing is not None:
                self._probe_outcome(proc, result, delay)
            elif proc.leading:
                self._lead(proc)
            else:
                self._elect(proc)

    def _elect(self, proc: Proc) -> None:
        """The prober thread looks at the group and runs for the probe lock while the
        group is OPEN or a reconciliation is owed."""
        with self._tx() as conn:
            view = self._breaker_view(conn, proc)
        if view.state == "CLOSED" and view.reconcile_epoch is None:
            return
        if proc.sitting_out:
            proc.sitting_out = False
            note("prober sat out an election")
            return
        won = proc.probe.acquire()
        expected = not any(p.holds for p in self.procs.values())
        assert won == expected, f"{proc} won the probe lock: {won}, expected {expected}"
        if won:
            proc.probe.run(proc.store.set_prober)
            proc.leading = proc.holds = True
            proc.turns = 0
            note("prober elected" if view.state == "OPEN" else "reconciler elected")

    def _lead(self, proc: Proc) -> None:
        """One turn of the elected prober's loop (`Prober._lead`): check the lock,
        then reconcile one batch, or finish, or wait, or claim the probe."""
        try:
            proc.probe.check()
        except LostLock:
            assert not proc.holds, f"{proc}: lock check failed while it holds the lock"
            self._step_down(proc)
            note("prober stepped down: lock lost")
            return
        assert proc.holds, f"{proc}: lock check passed though its lock session is gone"
        with self._tx() as conn:
            view = self._breaker_view(conn, proc)
        if view.reconcile_epoch is not None:
            self._reconcile(proc, view.reconcile_epoch, view.reconcile_from or 0)
        elif view.state == "CLOSED":
            self._step_down(proc)
            note("prober finished")
        elif view.probe_due:
            self._claim_probe(proc, view.epoch, view.probe_failures)
        else:
            note("prober waits for the probe time")

    def _step_down(self, proc: Proc) -> None:
        proc.probe.release()
        proc.leading = proc.holds = False

    def _reconcile(self, proc: Proc, close_epoch: int, from_epoch: int) -> None:
        """One batch of `Prober._reconcile`; an empty batch finishes it."""
        owed = {mid for mid, r in self.rows.items() if self._owed(r)}
        with self._tx() as conn:
            n = proc.store.reconcile_batch(
                conn, close_epoch, from_epoch, MAX_REFUNDS, RECONCILE_LIMIT
            )
            refunds = dict(
                conn.execute(
                    select(d.c.message_id, d.c.refunds).where(d.c.group_id == self.gid)
                ).all()
            )
        kept = {mid: r for mid, r in self.rows.items() if r.state != "deleted"}
        changed = {mid for mid, r in kept.items() if refunds[mid] != r.refunds}
        assert changed <= owed, f"refunded rows not owed a refund: {sorted(changed - owed)}"
        assert n == len(changed) == min(RECONCILE_LIMIT, len(owed)), (
            f"batch refunded {n} ({sorted(changed)}), owed {sorted(owed)}"
        )
        for mid in changed:
            row = self.rows[mid]
            assert refunds[mid] == row.refunds + 1
            self._refund(mid, close_epoch)
            if row.state == "dead" or row.error_class == "systemic":
                row.future = False
            row.state = "ready"
            row.attempts = max(0, row.attempts - row.ra)
            row.reclaims = max(0, row.reclaims - row.rr)
            row.ra = row.rr = 0
            row.refunds += 1
            row.error_class = None
            assert not (row.scheduled and not row.future), f"refund made row {mid} due early"
        self.totals["refunded"] += n
        self._history_add(close_epoch, n)
        note("reconciliation batch", 1)
        note("rows refunded by reconciliation", n)
        if n == 0:
            with self._tx() as conn:
                proc.store.reconcile_done(conn, close_epoch, from_epoch, MAX_REFUNDS)
            if self.brk.reconcile_epoch == close_epoch:
                self.brk.reconcile_epoch = self.brk.reconcile_from = None
            note("reconciliation finished")

    def _probe_candidates(self, at_epoch: int) -> list[list[int]]:
        """The probe candidates in the order `claim_probe` tries them: per kind (due
        now, systemic retry, dead and charged under the cap), the rows not yet probed
        in this outage, then those probed."""
        kinds = [
            [m for m, r in self.rows.items() if r.state == "ready" and not r.future],
            [
                m
                for m, r in self.rows.items()
                if r.state == "ready" and r.future and r.error_class == "systemic"
            ],
            [
                m
                for m, r in self.rows.items()
                if r.state == "dead" and r.charged and r.refunds < MAX_REFUNDS
            ],
        ]
        return [
            [m for m in kind if (self.rows[m].error_epoch == at_epoch) is probed]
            for kind in kinds
            for probed in (False, True)
        ]

    def _claim_probe(self, proc: Proc, epoch: int, failures: int) -> None:
        """`Prober._probe`'s claim: the probe slot, the row, the reservation."""
        classes = self._probe_candidates(epoch)
        slot = self.brk.state == "OPEN" and self.brk.epoch == epoch
        slot = slot and self.brk.probe_due
        with self._tx() as conn:
            times = {
                mid: (avail, upd)
                for mid, avail, upd in conn.execute(
                    select(d.c.message_id, d.c.available_at, d.c.updated_at).where(
                        d.c.group_id == self.gid
                    )
                )
            }
            row = proc.store.claim_probe(conn, epoch, MAX_REFUNDS, HOLD)
        first = next((i for i, cls in enumerate(classes) if cls), None)
        if not slot or first is None:
            assert row is None, f"probe claimed m{row and row.id} (slot {slot}, none to probe)"
            note("no probe: slot taken" if not slot else "no probe: nothing to probe with")
            with self._tx() as conn:  # `Prober._lead`: nothing left to probe closes
                closed = proc.store.close_idle(conn, epoch, MAX_REFUNDS)
            if slot and first is None:
                assert closed == epoch + 1, f"no idle close at {epoch}: {closed}"
                b = self.brk
                b.state, b.epoch, b.probe_due, b.failures = "CLOSED", epoch + 1, True, 0
                self.history.append([b.epoch, "CLOSED", 0])
                self.poison_probes = 0
                note("closed with nothing left to probe")
            else:
                assert closed is None, f"closed at {closed} with a probe in flight"
            return
        assert row is not None, f"no probe claimed; candidates {classes}"
        cls = classes[first]
        if first % 2:  # probed in this outage: least recently probed first
            expected = min(cls, key=lambda m: (times[m][1], m))
        elif first == 4:  # dead rows not yet probed: by id
            expected = min(cls)
        else:
            expected = min(cls, key=lambda m: (times[m][0], m))
        assert row.id == expected, f"probe took m{row.id}, expected m{expected} of {classes}"
        picked = self.rows[row.id]
        assert not picked.scheduled, f"probed row {row.id} before the time the user asked for"
        assert not self._owed(picked), f"probed row {row.id} before the refund it is owed"
        note(f"probe of a {('due', 'retry', 'dead')[first // 2]} row{' again' * (first % 2)}")
        if self.healthy:
            healthy = any(self.rows[m].poison is None for c in classes for m in c)
            if picked.poison is not None and healthy:
                self.poison_probes += 1
                bound = POISON_PROBES_PER_ROW * sum(
                    1 for r in self.rows.values() if r.poison is not None
                )
                assert self.poison_probes <= bound, (
                    f"{self.poison_probes} probes of poison rows while a healthy row waits"
                )
        assert row.attempts == picked.attempts
        picked.state, picked.owner, picked.seq = "leased", proc.name, row.seq
        picked.expired, picked.probe_of = False, epoch
        self.brk.probe_due = False
        held = Held(proc.name, proc.life, row, group_probe=True)
        proc.probing, proc.probe_view = held, (epoch, failures)

    def _probe_outcome(self, proc: Proc, result: str, delay: float) -> None:
        """The probe's handler returns; the prober writes its outcome (`Prober._probe`
        and the rest of its turn in `_lead`)."""
        held = proc.probing
        assert held is not None
        proc.probing = None
        epoch, failures = proc.probe_view
        row = self.rows[held.claimed.id]
        if self.healthy:
            result = row.poison or "done"
        current = self._current(held)
        if result == "done":
            self._probe_succeeded(proc, held, epoch, current)
            return
        out = self._outcome(held, result, delay)
        with self._tx() as conn:
            written = proc.store.record_probe(conn, out, MAX_ATTEMPTS)
        assert written is current
        if current and out.error_class == "systemic" and held.claimed.attempts >= MAX_ATTEMPTS:
            # a dead row's failed probe: no attempt, a refund spent if it had one before
            row.owner, row.expired, row.probe_of = None, False, None
            row.state, row.future, row.scheduled = "dead", False, False
            row.error_class, row.error_epoch = "systemic", held.claimed.epoch
            row.refunds += int(row.refunds > 0)
            note("failed probe of a dead row" + (" (a refund spent)" if row.refunds > 1 else ""))
        elif current:
            self._applied(held, out)
        note(f"probe {out.kind} {out.error_class or ''}{'' if current else ' (refused)'}")
        b = self.brk
        still = b.state == "OPEN" and b.epoch == epoch
        if out.error_class == "systemic":
            wait = probe_delay(failures + 1, PROBE_INTERVAL, PROBE_INTERVAL_MAX)
            with self._tx() as conn:
                count = proc.store.probe_failed(conn, epoch, wait)
            if still:
                b.failures += 1
                b.probe_due = False
            assert count == (b.failures if still else None)
            proc.turns += 1
            if proc.turns >= PROBER_TURNS:
                self._step_down(proc)
                proc.sitting_out = True
                note("prober sits out after its turns")
        else:
            proc.turns = 0
            wait = probe_delay(max(1, failures), PROBE_INTERVAL, PROBE_INTERVAL_MAX)
            with self._tx() as conn:
                proc.store.probe_again(conn, epoch, wait)
            if still:
                b.probe_due = False

    def _probe_succeeded(self, proc: Proc, held: Held, epoch: int, current: bool) -> None:
        """A successful probe: done with its charges refunded, and the close in the same
        transaction; a prober that lost its lock only writes the row and frees the slot."""
        row = self.rows[held.claimed.id]
        charged = current and row.charged
        try:
            proc.probe.check()
            lost = False
        except LostLock:
            lost = True
        assert lost is not proc.holds
        with self._tx() as conn:
            if lost:
                written, refunded = proc.store.probe_done(conn, held.claimed)
                closed = None
            else:
                written, closed = proc.store.probe_succeeded(conn, held.claimed, epoch)
        if lost:
            assert refunded == int(charged)
            with self._tx() as conn:
                proc.store.probe_again(conn, epoch, 0.0)
            if self.brk.state == "OPEN" and self.brk.epoch == epoch:
                self.brk.probe_due = True
        assert written is current
        if current:
            if charged:
                self._refund(held.claimed.id, epoch + 1)
                row.refunds += 1
                self.totals["refunded"] += 1
            row.state, row.owner, row.expired, row.probe_of = "done", None, False, None
            row.attempts = max(0, row.attempts - row.ra) + 1
            row.reclaims = max(0, row.reclaims - row.rr)
            row.ra = row.rr = 0
            row.error_class = None
        if lost:
            self._step_down(proc)
            note("probe succeeded after the prober lost its lock")
            return
        expected = self._close(epoch, int(charged))
        assert closed == expected, f"close gave {closed}, expected {expected}"
        if closed is not None:
            proc.see("CLOSED", closed)
            note("group closed by a probe" + (" (its lease was lost)" if not current else ""))
        else:
            note("probe succeeded, the group had moved on")

    def _lose_lock(self, proc: Proc) -> None:
        """The prober's lock session dies under it (its connection dropped); the prober
        finds out at its next lock check, and another member can be elected."""
        pid = proc.probe.run(lambda c: c.execute(text("SELECT pg_backend_pid()")).scalar_one())
        self.reader.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid})
        proc.holds = False
        note("probe lock lost" + (" mid-probe" if proc.probing else ""))
        if self.brk.reconcile_epoch is not None:
            note("probe lock lost with a reconciliation owed")
        self.poison_probes = 0

    # -- until empty --------------------------------------------------------------------

    def _drain_check(self, proc: Proc) -> None:
        """What stands between an idle member and an empty group: never empty while a
        row it could run is ready, a lease must still run out, or refunds are owed."""
        with self._tx() as conn:
            state = proc.store.drain_state(conn, TTL, 0.0)
        ready = [r for r in self.rows.values() if r.state == "ready"]
        held = [
            r
            for r in self.rows.values()
            if r.state == "leased"
            and (r.owner == proc.name or not (r.owner and self.procs[r.owner].live))
        ]
        expected = DrainState(
            ready_now=sum(1 for r in ready if not r.future),
            waiting_retry=sum(1 for r in ready if r.future),
            due_soon=0,
            held=len(held),
            reconciling=self.brk.reconcile_epoch is not None,
        )
        assert state == expected, f"drain state {state}, model {expected}"
        empty = state.ready_now + state.held + state.due_soon == 0 and not state.reconciling
        if empty:
            assert not any(r.state == "ready" and not r.future for r in self.rows.values())
            assert self.brk.reconcile_epoch is None
            note("until-empty: empty")
        elif state.reconciling:
            note("until-empty: waits for the reconciliation")
        else:
            note("until-empty: not empty")

    # -- invariants -----------------------------------------------------------------------

    def _db_rows(self) -> dict[int, tuple[Any, ...]]:
        now = func.now()
        query = select(
            d.c.message_id,
            d.c.state,
            d.c.attempts,
            d.c.reclaims,
            d.c.refundable_attempts,
            d.c.refundable_reclaims,
            d.c.refunds,
            d.c.error_class,
            d.c.error_epoch,
            d.c.available_at > now,
            d.c.lease_owner,
            d.c.lease_seq,
            d.c.lease_expires_at < now,
        ).where(d.c.group_id == self.gid)
        return {r[0]: tuple(r[1:]) for r in self.reader.execute(query)}

    @invariant()
    def database_agrees(self) -> None:
        """After every step: rows, breaker, history, totals and members as modelled."""
        SEEN["checks"] += 1
        db = self._db_rows()
        model = {mid: row.view() for mid, row in self.rows.items() if row.state != "deleted"}
        assert db.keys() == model.keys()
        wrong = {mid: (db[mid], model[mid]) for mid in db if db[mid] != model[mid]}
        assert not wrong, f"rows (database, model): {wrong}"
        state, *rest = self.reader.execute(
            select(
                br.c.state,
                br.c.epoch,
                func.coalesce(br.c.next_probe_at <= func.now(), True),
                br.c.probe_failures,
                br.c.reconcile_epoch,
                br.c.reconcile_from_epoch,
            ).where(br.c.group_id == self.gid)
        ).one()
        assert state in ("CLOSED", "OPEN"), f"persisted breaker state {state!r}"
        assert (state, *rest) == self.brk.view(), f"breaker {(state, *rest)}, {self.brk.view()}"
        history = [
            list(r)
            for r in self.reader.execute(
                select(hist.c.epoch, hist.c.state, hist.c.refunded)
                .where(hist.c.group_id == self.gid)
                .order_by(hist.c.epoch)
            )
        ]
        assert history == self.history, f"history {history}, model {self.history}"
        totals = self.reader.execute(
            select(gs.c.reclaimed_total, gs.c.released_total, gs.c.refunded_total).where(
                gs.c.group_id == self.gid
            )
        ).one()
        expected = (self.totals["reclaimed"], self.totals["released"], self.totals["refunded"])
        assert tuple(totals) == expected, f"totals {tuple(totals)}, model {expected}"
        members = {
            name: (local, tripped, live)
            for name, local, tripped, live in self.reader.execute(
                select(mb.c.name, mb.c.local_breaker, mb.c.tripped_epoch, member_live()).where(
                    mb.c.group_id == self.gid
                ),
                {
                    "ttl": dt.timedelta(seconds=TTL),
                    **lock_holders(self.reader, self.gid, "", ttl=TTL),
                },
            )
        }
        joined = {p.name: (*p.reported, p.live) for p in self.procs.values() if p.joined}
        assert members == joined, f"members {members}, model {joined}"
        probers = lock_holders(self.reader, self.gid, "prober")["prober_names"]
        prober = min(probers, default=None)
        holders = [p.name for p in self.procs.values() if p.holds]
        assert prober == (holders[0] if holders else None), f"prober {prober}, {holders}"
        for mid, row in self.rows.items():
            if row.scheduled:
                assert row.future, f"row {mid} is due before the time the user asked for"


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.timeout(0 if LONG_RUN else 120)
def test_breaker_state_machine(pg_dsn: str, schema: str) -> None:
    """Random interleavings of members, claims, outcomes, trips, opens, probes, closes
    and reconciliation keep every invariant of the breaker (see the module docstring)."""
    run_machine(BreakerMachine, pg_dsn, schema, SETTINGS, SEEN)
