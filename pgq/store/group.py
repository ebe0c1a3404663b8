"""`GroupStore`: the consumer's statements for one group and one member.

Each method takes the connection of the role that calls it (the caller owns
the transaction) and returns records from `pgq.records`. Rows are mapped by
name from the same column list the statement's `RETURNING` is built from.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable
from decimal import Decimal
from functools import partial
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.sql import Executable

from pgq.errors import PgqError, UnknownGroup
from pgq.logcontext import get_logger
from pgq.records import (
    BreakerView,
    Claimed,
    DrainState,
    ErrorClass,
    Lease,
    Message,
    Outcome,
    OutcomeKind,
    RowState,
    Sweep,
)
from pgq.sql import breaker as breaker_sql
from pgq.sql import claim as claim_sql
from pgq.sql import frontier as frontier_sql
from pgq.sql import lifecycle as lifecycle_sql
from pgq.sql import locks as locks_sql
from pgq.sql import members as member_sql
from pgq.sql import outcomes as outcome_sql
from pgq.sql import stats as stats_sql
from pgq.sql import status as status_sql
from pgq.sql.locks import (
    breaker_flip_key,
    group_key,
    lock_key,
    try_xact_lock,
    xact_lock,
    xact_lock_shared,
)
from pgq.store import placement
from pgq.store.connections import run_hot
from pgq.store.engine import schema_of
from pgq.store.members import lock_holders, member_table
from pgq.store.placement import distributed

logger = get_logger("pgq.store")

ERROR_TEXT_MAX = 2000

STATS_MIN_CHANGES = 1000
STATS_CHANGED_SHARE = 0.2
STATS_MIN_AGE = 30.0
VACUUM_MIN_DEAD = 50_000
"""Dead rows in `delivery` before a member vacuums it (and they must outnumber the
live rows `VACUUM_DEAD_SHARE` times, or reach `VACUUM_ENOUGH_DEAD`)."""
VACUUM_DEAD_SHARE = 2.0
VACUUM_ENOUGH_DEAD = 200_000
"""Dead rows that call for a vacuum however many rows live: behind a big backlog
they sit at the head of the ready index, where every claim walks over them."""
VACUUM_MIN_AGE = 5.0
"""Seconds since the last vacuum (anyone's) before a member vacuums again."""
"""ANALYZE delivery when at least 1,000 rows and 20 % of it changed since the last
analyze, and that one is at least 30 s old (see `pgq.sql.stats`)."""

UNSEEN_DELAY = 1.0
"""Seconds a claimed row whose message is not visible yet waits before it is due
again (on Citus: its publish has not committed on the topic's node yet)."""
UNSEEN = dt.timedelta(seconds=UNSEEN_DELAY)

EXPIRE_BATCH = 5000
"""Messages one retention statement deletes at most (one short transaction each)."""

_COL = {name: i for i, name in enumerate(claim_sql.CLAIMED)}
_ID, _SEQ, _ATTEMPTS = _COL["message_id"], _COL["lease_seq"], _COL["attempts"]
_KEY, _PAYLOAD, _HEADERS, _CREATED, _EPOCH = (
    _COL["key"],
    _COL["payload"],
    _COL["headers"],
    _COL["created_at"],
    _COL["epoch"],
)


def int_array(values: Iterable[int]) -> str:
    """An integer array as PostgreSQL's text literal: one string for the driver to
    send, instead of a list it would adapt element by element."""
    return "{" + ",".join(map(str, values)) + "}"


def clean_text(text: str | None, limit: int = ERROR_TEXT_MAX) -> str:
    """Text the database accepts: NUL bytes and lone surrogates escaped, at most
    `limit` characters."""
    if not text:
        return ""
    text = text[:limit].replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _lease_params(leases: Iterable[Lease]) -> dict[str, str]:
    leases = list(leases)
    return {
        "ids": int_array(lease.id for lease in leases),
        "seqs": int_array(lease.seq for lease in leases),
    }


def _leases(rows: Iterable[Any]) -> set[Lease]:
    return {Lease(int(r[0]), int(r[1])) for r in rows}


def vacuum_due(dead: int, live: int) -> bool:
    """Do `dead` row versions call for a VACUUM of a delivery table with `live` rows?
    (At least `VACUUM_MIN_DEAD`, and `VACUUM_DEAD_SHARE` times the live rows or
    `VACUUM_ENOUGH_DEAD`, whichever is less.)"""
    return dead >= max(VACUUM_MIN_DEAD, min(VACUUM_DEAD_SHARE * live, VACUUM_ENOUGH_DEAD))


TOKEN_BITS = 20
"""Claims per drawn block of lease tokens (2^20)."""


def _holders(params: dict[str, Any]) -> set[tuple[int, str]]:
    return set(zip(params["present_gids"], params["present_names"], strict=True))


def _row_state(kind: OutcomeKind) -> RowState:
    """The state an outcome of `kind` leaves its row in: done, dead, or ready again
    (a retry or a snooze)."""
    if kind == OutcomeKind.DONE:
        return RowState.DONE
    if kind == OutcomeKind.DEAD:
        return RowState.DEAD
    return RowState.READY


class LeaseTokens:
    """The lease tokens of one member process (decision 0004): one value v drawn from
    the `lease_token` sequence, then -(v * 2^TOKEN_BITS + k) for k = 0, 1, …, a new
    v when the block is used up. Unique across every claim of every member: blocks
    never overlap, and members of earlier versions drew positive tokens. Drawn in the
    claim's own transaction (or autocommitted before it), one statement per 2^20
    claims."""

    def __init__(self) -> None:
        self._block = 0
        self._next = 1 << TOKEN_BITS  # no block yet
        self._lock = threading.Lock()

    def next(self, conn: Connection) -> int:
        with self._lock:
            if self._next >= 1 << TOKEN_BITS:
                [(block,)] = run_hot(conn, claim_sql.token_block(), {})
                if not 0 < block < 1 << (63 - TOKEN_BITS):
                    raise PgqError(f"lease_token sequence out of range for token blocks: {block}")
                self._block, self._next = block, 0
            token = -((self._block << TOKEN_BITS) | self._next)
            self._next += 1
            return token


class GroupStore:
    """The consumer's statements for one group and member, run on a role's connection."""

    def __init__(
        self,
        gid: int,
        group: str,
        topic: str,
        member: str,
        lease: float,
        max_reclaims: int,
        *,
        topic_id: int | None = None,
    ) -> None:
        self.gid = gid
        self.group = group
        self.topic = topic
        self.topic_id = topic_id
        """The topic's id (looked up at the first claim that needs it, when None)."""
        self.split_claim: bool | None = None
        """Read the claimed messages in a statement of their own: on Citus, where they
        live on the topic's shard (`pgq.sql.claim.lease_picked`). Asked at the first
        claim."""
        self.member = member
        self.lease = dt.timedelta(seconds=lease)
        self.max_reclaims = max_reclaims
        self.started: dt.datetime | None = None
        """When this process joined (its join's token; None before it joined)."""
        self.tokens = LeaseTokens()

    # -- claim path ---------------------------------------------------------

    def claim(self, conn: Connection, limit: int, epoch: int, probe: bool = False) -> list[Claimed]:
        """Lease up to `limit` ready rows to this member (rounded down to a power of two
        below 64, so only a few claim statements are ever prepared)."""
        if limit < 1:
            return []
        if limit < 64:
            limit = 1 << (limit.bit_length() - 1)
        params = {
            "gid": self.gid,
            "member": self.member,
            "lease": self.lease,
            "token": self.tokens.next(conn),
        }
        rows = self._lease(conn, partial(claim_sql.claim, limit), params)
        return self._claimed(rows, epoch, probe)

    def _lease(
        self, conn: Connection, statement: Callable[[bool], Executable], params: dict[str, Any]
    ) -> list[Any]:
        """Run a claim statement (`statement(bodies)`); its rows as `CLAIMED` orders them.
        With `split_claim`, the messages are read by a second statement."""
        if self.split_claim is None:
            self.split_claim = distributed(conn)
        if not self.split_claim:
            return run_hot(conn, statement(True), params)
        leased = run_hot(conn, statement(False), params)
        if not leased:
            return []
        if self.topic_id is None:
            [(self.topic_id,)] = run_hot(conn, claim_sql.topic_of_group(), {"gid": self.gid})
        found = run_hot(
            conn,
            claim_sql.message_bodies(),
            {"topic_id": self.topic_id, "ids": int_array(r[0] for r in leased)},
        )
        bodies = {r[0]: r[1:] for r in found}
        rows, unseen = [], []
        for message_id, seq, attempts, epoch in leased:
            body = bodies.get(message_id)
            if body is None:
                unseen.append(Lease(message_id, seq))
            else:
                rows.append((message_id, seq, attempts, *body, epoch))
        if unseen:
            logger.info(
                "claimed messages not visible yet group=%s ids=%s: back in %g s",
                *(self.group, [lease.id for lease in unseen], UNSEEN_DELAY),
            )
            params = {"gid": self.gid, "member": self.member, "delay": UNSEEN}
            run_hot(conn, claim_sql.postpone(), {**params, **_lease_params(unseen)})
        return rows

    def claim_probe(
        self, conn: Connection, epoch: int, max_refunds: int, hold: float
    ) -> Claimed | None:
        """Lease the group probe of the OPEN `epoch` (DESIGN §6.4): a row due now, else the
        systemic retry due soonest, else a dead row the outage charged under the refund cap; within
        each kind the rows not yet probed in this outage first, then the least
        recently probed.

        Only when the stored next probe time has come, and then it reserves the next
        `hold` seconds in the same transaction (the prober renews them with
        `renew_probe` while the handler runs): one probe in flight per group, even
        when a prober lost its lock mid-probe. None when no probe may start (or the
        group moved on) or there is nothing to probe with.
        """
        params = {
            "gid": self.gid,
            "member": self.member,
            "lease": self.lease,
            "at_epoch": epoch,
            "max_refunds": max_refunds,
        }
        if conn.execute(breaker_sql.probe_slot(), params).one_or_none() is None:
            return None
        params["token"] = self.tokens.next(conn)
        for kind in breaker_sql.PROBE_KINDS:
            for probed in (False, True):
                rows = self._lease(conn, partial(breaker_sql.claim_probe, kind, probed), params)
                if rows:
                    self.renew_probe(conn, epoch, hold)
                    return self._claimed(rows, epoch, probe=True)[0]
        return None

    def renew_probe(self, conn: Connection, epoch: int, hold: float) -> bool:
        """Keep the probe slot of the OPEN `epoch` reserved for the next `hold` seconds;
        False when the group is no longer OPEN at `epoch`."""
        params = {"gid": self.gid, "at_epoch": epoch, "hold": dt.timedelta(seconds=hold)}
        return bool(conn.execute(breaker_sql.reserve_probe(), params).rowcount)

    def probe_done(self, conn: Connection, row: Claimed) -> tuple[bool, int]:
        """Write a successful group probe (refunding its systemic charges): (written,
        rows refunded: 0 or 1)."""
        params = {"gid": self.gid, "id": row.id, "seq": row.seq, "member": self.member}
        charged = conn.execute(breaker_sql.probe_charges(), params).scalar()
        if charged is None:
            return False, 0  # the lease is gone
        refunded = 1 if charged else 0
        conn.execute(breaker_sql.probe_done(), {**params, "refunded": refunded})
        if refunded:
            add = claim_sql.add_to_total("refunded_total")
            conn.execute(add, {"gid": self.gid, "n": refunded})
        return True, refunded

    def probe_succeeded(
        self, conn: Connection, row: Claimed, epoch: int
    ) -> tuple[bool, int | None]:
        """Write the successful probe and close the group at `epoch` in one transaction,
        so the close's history row counts the probe's refund: (written, close epoch)."""
        written, refunded = self.probe_done(conn, row)
        return written, self.close(conn, epoch, refunded, row.id)

    def record_probe(self, conn: Connection, outcome: Outcome, max_attempts: int) -> bool:
        """Write a group probe's failure (or snooze); True when written. A systemic
        failure of a row that was dead at `max_attempts` stays dead without another
        attempt charged, and spends a refund if a close had refunded the row before
        (`breaker_sql.probe_failed_dead`); any other outcome is written like a worker's."""
        row = outcome.claimed
        if outcome.error_class != ErrorClass.SYSTEMIC or row.attempts < max_attempts:
            return row.lease in self.record(conn, [outcome])
        params = {
            "gid": self.gid,
            "id": row.id,
            "seq": row.seq,
            "member": self.member,
            "at_epoch": row.epoch,
            "error": clean_text(outcome.error),
        }
        return conn.execute(breaker_sql.probe_failed_dead(), params).first() is not None

    def _claimed(self, rows: Iterable[Any], epoch: int, probe: bool = False) -> list[Claimed]:
        """The claimed rows as `Claimed`, filed under the later of `epoch` (what the
        caller's gate knows) and the epoch the claim saw in the database."""
        rows = list(rows)
        if rows:
            epoch = max(epoch, rows[0][_EPOCH] or 0)
        group, topic, loads = self.group, self.topic, json.loads
        try:
            return [
                Claimed(
                    Message(
                        r[_ID],
                        topic,
                        group,
                        r[_KEY],
                        loads(r[_PAYLOAD]),
                        r[_HEADERS] and loads(r[_HEADERS]),
                        r[_ATTEMPTS] + 1,
                        r[_CREATED],
                    ),
                    r[_SEQ],
                    r[_ATTEMPTS],
                    epoch,
                    probe,
                )
                for r in rows
            ]
        except (RecursionError, ValueError):  # written by another client: row by row
            return [self._claimed_carefully(r, epoch, probe) for r in rows]

    def _claimed_carefully(self, r: Any, epoch: int, probe: bool) -> Claimed:
        """One claimed row whose payload or headers may not decode (nested deeper
        than Python's JSON decoder goes): such a row is claimed `unreadable`."""
        try:
            payload = json.loads(r[_PAYLOAD])
            headers = r[_HEADERS] and json.loads(r[_HEADERS])
            unreadable = None
        except (RecursionError, ValueError) as exc:
            payload = headers = None
            unreadable = f"the stored message cannot be decoded: {type(exc).__name__}: {exc}"
            logger.warning("message cannot be decoded id=%d group=%s", r[_ID], self.group)
        message = Message(
            r[_ID], self.topic, self.group, r[_KEY], payload, headers, r[_ATTEMPTS] + 1, r[_CREATED]
        )
        return Claimed(message, r[_SEQ], r[_ATTEMPTS], epoch, probe, unreadable)

    def extend(self, conn: Connection, leases: list[Lease]) -> set[Lease]:
        """Extend the given leases; returns those still held."""
        params = {"gid": self.gid, "member": self.member, "lease": self.lease}
        rows = run_hot(conn, claim_sql.extend_leases(), {**params, **_lease_params(leases)})
        return _leases(rows)

    def release(self, conn: Connection, leases: list[Lease]) -> set[Lease]:
        """Hand unstarted leased rows back to ready, uncharged; returns those released."""
        if not leases:
            return set()
        params = {"gid": self.gid, "member": self.member, **_lease_params(leases)}
        released = _leases(run_hot(conn, claim_sql.release(), params))
        if released:
            add = claim_sql.add_to_total("released_total")
            conn.execute(add, {"gid": self.gid, "n": len(released)})
        return released

    def sweep(self, conn: Connection, limit: int = 1000) -> Sweep:
        """Reclaim rows whose lease expired without an outcome."""
        rows = conn.execute(
            claim_sql.sweep_expired(),
            {"gid": self.gid, "limit": limit, "max_reclaims": self.max_reclaims},
        ).all()
        if rows:
            add = claim_sql.add_to_total("reclaimed_total")
            conn.execute(add, {"gid": self.gid, "n": len(rows)})
        return Sweep(len(rows), sum(1 for r in rows if r.state == RowState.DEAD))

    # -- outcomes -----------------------------------------------------------

    def record(self, conn: Connection, outcomes: list[Outcome]) -> set[Lease]:
        """Write a batch of outcomes (one statement per kind: successes, failures);
        returns the leases applied."""
        done = [o.claimed.lease for o in outcomes if o.kind == OutcomeKind.DONE]
        failed = [o for o in outcomes if o.kind != OutcomeKind.DONE]
        applied: set[Lease] = set()
        if done:
            params = {"gid": self.gid, "member": self.member, **_lease_params(done)}
            applied |= _leases(run_hot(conn, outcome_sql.ack_done(), params))
        if failed:
            params = {
                "gid": self.gid,
                "member": self.member,
                "ids": [o.claimed.id for o in failed],
                "seqs": [o.claimed.seq for o in failed],
                "states": [_row_state(o.kind) for o in failed],
                "charges": [0 if o.kind == OutcomeKind.SNOOZE else 1 for o in failed],
                "delays": [o.delay for o in failed],
                "classes": [o.error_class for o in failed],
                "errors": [clean_text(o.error) for o in failed],
                "epochs": [o.claimed.epoch for o in failed],
            }
            applied |= _leases(run_hot(conn, outcome_sql.record_failures(), params))
        return applied

    def settled(self, conn: Connection, outcomes: list[Outcome]) -> set[Lease]:
        """Of `outcomes` whose write was not seen to apply, the leases the database shows
        settled exactly as their outcome says (a write that committed but whose answer
        a cut connection lost): done rows for successes; for failures the state and
        the attempt count the outcome sets (an expiry sweep leaves the count alone)."""
        if not outcomes:
            return set()
        params = {
            "gid": self.gid,
            "ids": [o.claimed.id for o in outcomes],
            "seqs": [o.claimed.seq for o in outcomes],
        }
        rows = {(r[0], r[1]): r for r in conn.execute(outcome_sql.settled(), params)}
        found: set[Lease] = set()
        for o in outcomes:
            row = rows.get(o.claimed.lease)
            if row is None:
                continue
            state = _row_state(o.kind)
            charge = 0 if o.kind in (OutcomeKind.DONE, OutcomeKind.SNOOZE) else 1
            if row[2] == state and (
                o.kind == OutcomeKind.DONE or row[3] == o.claimed.attempts + charge
            ):
                found.add(o.claimed.lease)
        return found

    # -- group breaker --------------------------------------------------------

    def breaker(self, conn: Connection) -> BreakerView:
        """The group breaker row."""
        r = conn.execute(breaker_sql.state(), {"gid": self.gid}).mappings().one()
        return BreakerView(**r)

    def open_on_quorum(
        self, conn: Connection, epoch: int, *, ttl: float, min_members: int, quorum: float
    ) -> int | None:
        """Open the group if the quorum of live tripped members is there; the new epoch.
        Takes the group's breaker-flip lock first (a purge running now finishes on
        the breaker it read, or waits for this open).

        Liveness is read apart from the statement (`lock_holders`), so the holders
        are read again after it: if they changed, the open is undone (a savepoint)
        and the next heartbeat tries again. Otherwise the member rows the statement
        read and the locks held before and after it describe one moment: a member
        killed between the reads, counted live, with others leaving meanwhile, made
        a quorum that never existed (docs/defects.md)."""
        conn.execute(xact_lock(breaker_flip_key(schema_of(conn), self.group)))
        before = lock_holders(conn, self.gid, "", ttl=ttl)
        params = {
            **before,
            "gid": self.gid,
            "at_epoch": epoch,
            "member": self.member,
            "ttl": dt.timedelta(seconds=ttl),
            "min_members": min_members,
            "quorum": Decimal(str(quorum)),
        }
        with conn.begin_nested() as attempt:
            opened = conn.execute(breaker_sql.open_on_quorum(), params).scalar()
            after = lock_holders(conn, self.gid, "", ttl=ttl)
            if opened is None or _holders(after) == _holders(before):
                return opened
            attempt.rollback()
        logger.info("quorum open undone group=%s: members came or went meanwhile", self.group)
        return None

    def set_prober(self, lock_conn: Connection) -> None:
        """Name this member the prober, on the session that holds the probe lock: it
        records the name and takes the member's prober lock, which `pgq status` reads
        from pg_locks (so the name goes when that session does)."""
        params = {"gid": self.gid, "member": self.member}
        lock_conn.execute(breaker_sql.set_prober(), params)
        lock_conn.execute(breaker_sql.mark_prober(), {**params, "table": member_table(lock_conn)})

    def unset_prober(self, lock_conn: Connection) -> None:
        """This member stepped down as prober: drop the prober lock `set_prober` took
        on the session that goes on holding the member's liveness."""
        params = {"gid": self.gid, "member": self.member, "table": member_table(lock_conn)}
        lock_conn.execute(breaker_sql.unmark_prober(), params)

    def probe_failed(
        self, conn: Connection, epoch: int, delay: float, message_id: int | None = None
    ) -> int | None:
        """The probe on `message_id` failed systemically: back the next probe off by
        `delay` and log the probe; returns the consecutive failure count."""
        params = {
            "gid": self.gid,
            "at_epoch": epoch,
            "delay": dt.timedelta(seconds=delay),
            "member": self.member,
            "probe_id": message_id,
        }
        return conn.execute(breaker_sql.probe_failed(), params).scalar()

    def probe_again(
        self,
        conn: Connection,
        epoch: int,
        delay: float,
        outcome: str | None = None,
        message_id: int | None = None,
        error_class: str | None = None,
    ) -> None:
        """The next probe is due in `delay` seconds, the failure count kept (after an
        inconclusive probe; 0 frees a reserved slot). With an `outcome` the probe on
        `message_id` is logged too, in the same statement; without one (a slot freed)
        nothing is logged."""
        params: dict[str, Any] = {
            "gid": self.gid,
            "at_epoch": epoch,
            "delay": dt.timedelta(seconds=delay),
        }
        if outcome is not None:
            params.update(
                member=self.member, probe_id=message_id, outcome=outcome, error_class=error_class
            )
        conn.execute(breaker_sql.probe_again(outcome is not None), params)

    def close(
        self, conn: Connection, epoch: int, refunded: int = 0, message_id: int | None = None
    ) -> int | None:
        """Close the group if still OPEN at `epoch` and log the successful probe (on
        `message_id`); returns the close epoch. `refunded`: rows the successful probe
        refunded, recorded in the close's history row."""
        params = {
            "gid": self.gid,
            "at_epoch": epoch,
            "member": self.member,
            "refunded": refunded,
            "probe_id": message_id,
        }
        return conn.execute(breaker_sql.close(), params).scalar()

    def close_idle(self, conn: Connection, epoch: int, max_refunds: int) -> int | None:
        """Close the group if still OPEN at `epoch`, its probe time has come and no row is
        a probe candidate; returns the close epoch (no reconciliation owed for it)."""
        params = {
            "gid": self.gid,
            "at_epoch": epoch,
            "member": self.member,
            "max_refunds": max_refunds,
        }
        return conn.execute(breaker_sql.close_idle(), params).scalar()

    def reconcile_batch(
        self, conn: Connection, close_epoch: int, from_epoch: int, max_refunds: int, limit: int
    ) -> int:
        """Refund one batch of the rows the outage charged, for this close; returns how many."""
        params = {
            "gid": self.gid,
            "close_epoch": close_epoch,
            "from_epoch": from_epoch,
            "max_refunds": max_refunds,
            "limit": limit,
        }
        return int(conn.execute(breaker_sql.reconcile_batch(), params).scalar() or 0)

    def reconcile_done(
        self, conn: Connection, close_epoch: int, from_epoch: int, max_refunds: int
    ) -> bool:
        """Mark the reconciliation finished unless a row it owes is left; True if it did."""
        params = {
            "gid": self.gid,
            "close_epoch": close_epoch,
            "from_epoch": from_epoch,
            "max_refunds": max_refunds,
        }
        return conn.execute(breaker_sql.reconcile_done(), params).first() is not None

    # -- frontier and housekeeping -------------------------------------------

    def advance_frontier(self, conn: Connection) -> int | None:
        """Advance the committed frontier as far as it may go; returns rows pruned,
        or None when another member holds the group row right now.

        One statement, so the decision comes from one snapshot (see
        `frontier_sql.advance_frontier`)."""
        conn.execute(frontier_sql.without_jit())
        held, pruned = conn.execute(frontier_sql.advance_frontier(), {"gid": self.gid}).one()
        return int(pruned) if held else None

    def refresh_statistics(self, conn: Connection) -> bool:
        """ANALYZE the delivery table when it changed a lot since its statistics were
        taken (one member at a time); returns whether it did."""
        schema = schema_of(conn)
        row = conn.execute(
            stats_sql.delivery_changes(), {"relation": f'"{schema}".delivery'}
        ).one_or_none()
        if row is None:
            return False
        changed, live, age = int(row[0] or 0), int(row[1] or 0), row[2]
        if changed < STATS_MIN_CHANGES or changed < STATS_CHANGED_SHARE * live:
            return False
        if age is not None and float(age) < STATS_MIN_AGE:
            return False
        if not conn.execute(try_xact_lock(lock_key(schema, "analyze"))).scalar():
            return False
        driver = conn.connection.driver_connection
        assert driver is not None
        driver.execute(stats_sql.analyze(schema))
        logger.debug("analyzed delivery schema=%s changed=%d live=%d", schema, changed, live)
        return True

    def vacuum_dead_rows(self, conn: Connection) -> bool:
        """VACUUM the delivery table when dead row versions dominate it and this
        session may (it owns the table); returns whether it did. Runs its statements
        on the driver: the caller runs it outside a transaction (`single=True`),
        which VACUUM needs."""
        schema = schema_of(conn)
        rows = run_hot(conn, stats_sql.delivery_dead(), {"relation": f'"{schema}".delivery'})
        if not rows:
            return False
        dead, live, age, may = int(rows[0][0] or 0), int(rows[0][1] or 0), rows[0][2], rows[0][3]
        if not may or not vacuum_due(dead, live):
            return False
        if age is not None and float(age) < VACUUM_MIN_AGE:
            return False
        driver = conn.connection.driver_connection
        assert driver is not None
        notices: list[str] = []

        def note(diagnostic: Any) -> None:
            notices.append(diagnostic.message_primary or "")

        driver.add_notice_handler(note)
        try:
            driver.execute(stats_sql.vacuum(schema))
        finally:
            driver.remove_notice_handler(note)
        if any(n.startswith("skipping") for n in notices):  # SKIP_LOCKED: another runs
            logger.info("vacuum of delivery skipped schema=%s (another vacuum runs)", schema)
            return False
        logger.info("vacuumed delivery schema=%s dead=%d live=%d", schema, dead, live)
        return True

    def prune_behind(self, conn: Connection) -> int:
        """Prune done rows that finished behind the frontier after it passed them."""
        return int(conn.execute(frontier_sql.prune_behind(), {"gid": self.gid}).scalar() or 0)

    def expire_messages(
        self, conn: Connection, topic_id: int, retention: float, limit: int = EXPIRE_BATCH
    ) -> int:
        """Delete one batch of messages past retention that no group still holds;
        returns how many.

        Takes the topic lock first, in its own statement, so that retention and a
        subscribe's backfill never race (see `lock_topic_for_retention`). On Citus
        that lock is the coordinator's advisory lock (a row lock on the reference
        table `topic` would lock every topic), and the delete is three routed steps
        (`expired_candidates`, `held_by_group` per group, `delete_messages`): the
        one statement joins `message` and `delivery`, which Citus refuses.
        """
        params = {
            "topic_id": topic_id,
            "retention": dt.timedelta(seconds=retention),
            "limit": limit,
        }
        if not placement.distributed(conn):
            conn.execute(frontier_sql.lock_topic_for_retention(), {"topic_id": topic_id})
            return len(conn.execute(frontier_sql.delete_expired_messages(), params).all())
        key = locks_sql.topic_key(schema_of(conn), self.topic)
        conn.execute(locks_sql.topic_lock(shared=True), {"key": key})
        conn.execute(frontier_sql.without_jit())
        groups = conn.execute(frontier_sql.groups_of_topic(), params).scalars().all()
        nodes = set(placement.nodes_of(conn, f'"{schema_of(conn)}".delivery', groups).values())
        free: list[int] = []
        after = 0
        while len(free) < limit:
            page = conn.execute(frontier_sql.expired_candidates(), {**params, "after": after})
            ids = list(page.scalars())
            if not ids:
                break
            # a message seen committed may have its delivery rows still prepared on a
            # group's node (its commit reaches nodes one after the other): invisible to
            # `held_by_group`, and deleted under them (tests/citus/test_two_phase.py)
            if nodes & placement.nodes_committing(conn, placement.cutoff(conn)):
                logger.info("retention waits for two-phase commits topic=%s", self.topic)
                break
            after = ids[-1]
            free += self._unheld(conn, groups, ids)
        if not free:
            return 0
        victims = {"topic_id": topic_id, "ids": free[:limit]}
        return len(conn.execute(frontier_sql.delete_messages(), victims).all())

    @staticmethod
    def _unheld(conn: Connection, groups: Iterable[int], ids: list[int]) -> list[int]:
        """Of messages `ids`, those none of `groups` has a delivery row for: one
        routed statement per group, until none is left."""
        left = set(ids)
        for gid in groups:
            if not left:
                break
            held = conn.execute(frontier_sql.held_by_group(), {"gid": gid, "ids": sorted(left)})
            left.difference_update(held.scalars())
        return sorted(left)

    def expire_probes(self, conn: Connection, retention: float, limit: int = EXPIRE_BATCH) -> int:
        """Delete one batch of this group's logged probes older than `retention`
        seconds; returns how many."""
        params = {"gid": self.gid, "retention": dt.timedelta(seconds=retention), "limit": limit}
        return int(conn.execute(frontier_sql.delete_expired_probes(), params).scalar() or 0)

    # -- membership -----------------------------------------------------------

    def join(self, conn: Connection, ttl: float, takeover: bool) -> bool:
        """Register this member; False when a live member already has the name.

        `takeover`: the caller holds the member's session lock (so whoever had the
        name before is gone); without it, only a row not heard from within `ttl`
        is taken over.

        Two statements (insert a new row, else take the existing one over); a row
        deleted between them (`forget_departed`) makes the name free, so the insert
        is tried once more. Of concurrent starters exactly one joins.

        First it waits for an unsubscribe of the group under way (the group lock,
        shared; `pgq.store.lifecycle.unsubscribe` takes it exclusively), then
        raises `UnknownGroup` when the group is gone: a member never registers in
        a removed group."""
        conn.execute(xact_lock_shared(group_key(schema_of(conn), self.group)))
        if conn.execute(lifecycle_sql.group_exists(), {"gid": self.gid}).first() is None:
            raise UnknownGroup(f"group {self.group!r} was removed (pgq unsubscribe)")
        params = {
            "gid": self.gid,
            "member": self.member,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ttl": dt.timedelta(seconds=ttl),
            "takeover": takeover,
        }
        for _ in range(2):
            row = conn.execute(member_sql.join_new(), params).one_or_none()
            if row is None:
                row = conn.execute(member_sql.join_existing(), params).one_or_none()
            if row is not None:
                self.started = row.started_at
                return True
        return False

    def _me(self) -> dict[str, Any]:
        return {"gid": self.gid, "member": self.member, "started": self.started}

    def heartbeat(
        self, conn: Connection, local: str, tripped_epoch: int | None
    ) -> tuple[str, int] | None:
        """Record liveness and local breaker state; returns (group state, epoch), or
        None when another process has taken this member's name over."""
        params = {**self._me(), "local": local, "tripped_epoch": tripped_epoch}
        row = conn.execute(member_sql.heartbeat(), params).one_or_none()
        return None if row is None else (str(row.state), int(row.epoch))

    def leave(self, conn: Connection) -> None:
        """Mark this member as gone (not the process that took its name over)."""
        conn.execute(member_sql.leave(), self._me())

    def lag(self, conn: Connection) -> int:
        """The group's messages not yet resolved (ready + leased), as `pgq status`."""
        return int(conn.execute(status_sql.group_lag(), {"gid": self.gid}).scalar() or 0)

    def drain_state(self, conn: Connection, ttl: float, wait: float = 0.0) -> DrainState:
        """Rows ready now, waiting for retry (and of those, due within `wait` seconds),
        and leased by us or by members that are not live.

        Liveness is read apart from the statement (`lock_holders`), so the holders
        are read again after it, and the statement runs again with them until both
        reads agree: a member killed between the first read and the statement would
        count as live, and a drain would end with its rows still leased (as the
        quorum open does, `open_on_quorum`)."""
        holders = lock_holders(conn, self.gid, "", ttl=ttl)
        while True:
            params = {
                **holders,
                "gid": self.gid,
                "member": self.member,
                "ttl": dt.timedelta(seconds=ttl),
                "wait": dt.timedelta(seconds=wait),
            }
            state = DrainState(**conn.execute(member_sql.drain_state(), params).mappings().one())
            after = lock_holders(conn, self.gid, "", ttl=ttl)
            if _holders(after) == _holders(holders):
                return state
            holders = after
