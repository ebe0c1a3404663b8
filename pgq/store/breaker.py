"""The group breaker's statements in `GroupStore`: open, probe, close, reconcile."""

from __future__ import annotations

import datetime as dt
import time
from decimal import Decimal
from functools import partial
from typing import Any

from sqlalchemy import Connection

from pgq.logcontext import get_logger
from pgq.records import (
    BreakerView,
    Claimed,
    ErrorClass,
    Outcome,
)
from pgq.sql import breaker as breaker_sql
from pgq.sql import claim as claim_sql
from pgq.sql.locks import (
    breaker_flip_key,
    xact_lock,
)
from pgq.store.claims import Claims
from pgq.store.engine import schema_of
from pgq.store.members import lock_holders, member_table
from pgq.store.outcomes import Outcomes, clean_text
from pgq.store.scope import present_holders

logger = get_logger("pgq.store")


class BreakerStore(Claims, Outcomes):
    """The group breaker as a member sees and moves it: its state, the open on quorum,
    the prober's name, the probe (its claim, slot and outcome), the close and the
    reconciliation (DESIGN §6)."""

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
            if opened is None or present_holders(after) == present_holders(before):
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
        started = time.monotonic()
        for kind in breaker_sql.PROBE_KINDS:
            for probed in (False, True):
                statement = partial(breaker_sql.claim_probe, kind, probed, ordered=self.ordered)
                rows = self._lease(conn, statement, params)
                if rows:
                    self.renew_probe(conn, epoch, hold)
                    return self._claimed(rows, epoch, True, started)[0]
        return None

    def renew_probe(self, conn: Connection, epoch: int, hold: float) -> bool:
        """Keep the probe slot of the OPEN `epoch` reserved for the next `hold` seconds;
        False when the group is no longer OPEN at `epoch`."""
        params = {"gid": self.gid, "at_epoch": epoch, "hold": dt.timedelta(seconds=hold)}
        return bool(conn.execute(breaker_sql.reserve_probe(), params).rowcount)

    def probe_done(
        self, conn: Connection, row: Claimed, close_epoch: int | None = None
    ) -> tuple[bool, int]:
        """Write a successful group probe (refunding its systemic charges; the refund's
        history line says `close_epoch`, else the epoch the probe ran under): (written,
        rows refunded: 0 or 1)."""
        refunded = self._probe_charges(conn, row)
        if refunded is None:
            return False, 0  # the lease is gone
        self._probe_done(conn, row, refunded, close_epoch)
        return True, refunded

    def _probe_charges(self, conn: Connection, row: Claimed) -> int | None:
        """Rows the probe on `row` would refund (0 or 1), its row locked; None when the
        lease is gone."""
        params = {"gid": self.gid, "id": row.id, "seq": row.seq, "member": self.member}
        charged = conn.execute(breaker_sql.probe_charges(), params).scalar()
        return None if charged is None else (1 if charged else 0)

    def _probe_done(
        self, conn: Connection, row: Claimed, refunded: int, close_epoch: int | None
    ) -> None:
        params = {
            "gid": self.gid,
            "id": row.id,
            "seq": row.seq,
            "member": self.member,
            "refunded": refunded,
            "close_epoch": row.epoch if close_epoch is None else close_epoch,
        }
        conn.execute(breaker_sql.probe_done(), params)
        if refunded:
            add = claim_sql.add_to_total("refunded_total")
            conn.execute(add, {"gid": self.gid, "n": refunded})

    def probe_succeeded(
        self, conn: Connection, row: Claimed, epoch: int
    ) -> tuple[bool, int | None]:
        """Write the successful probe and close the group at `epoch` in one transaction,
        so the close's history row counts the probe's refund: (written, close epoch).
        The close comes first (the row is locked by then), so that the refund's line
        names the close's epoch, as the reconciliation's lines do."""
        refunded = self._probe_charges(conn, row)
        closed = self.close(conn, epoch, refunded or 0, row.id)
        if refunded is None:
            return False, closed  # the lease is gone
        self._probe_done(conn, row, refunded, closed)
        return True, closed

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
            "member": self.member,
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
