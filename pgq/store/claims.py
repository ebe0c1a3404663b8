"""The claim path of `GroupStore`: claim, extend, release and sweep leases."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, cast

from sqlalchemy import Connection
from sqlalchemy.sql import Executable

from pgq.logcontext import get_logger
from pgq.records import (
    Claimed,
    Lease,
    Message,
    RowState,
    Sweep,
)
from pgq.sql import claim as claim_sql
from pgq.store.connections import run_hot
from pgq.store.placement import distributed
from pgq.store.scope import GroupScope, int_array, lease_params, lease_set

logger = get_logger("pgq.store")

UNSEEN_DELAY = 1.0
"""Seconds a claimed row whose message is not visible yet waits before it is due
again (on Citus: its publish has not committed on the topic's node yet)."""
UNSEEN = dt.timedelta(seconds=UNSEEN_DELAY)

_COL = {name: i for i, name in enumerate(claim_sql.CLAIMED)}
_ID, _SEQ, _ATTEMPTS = _COL["message_id"], _COL["lease_seq"], _COL["attempts"]
_KEY, _PAYLOAD, _HEADERS, _CREATED, _EPOCH = (
    _COL["key"],
    _COL["payload"],
    _COL["headers"],
    _COL["created_at"],
    _COL["epoch"],
)

_scan: Callable[[str, int], tuple[Any, int]] = cast(Any, json.JSONDecoder()).scan_once
"""The scanner `json.loads` runs (`JSONDecoder.scan_once`, C when available)."""


def _loads(text: str) -> Any:
    """`json.loads(text)` for the JSON text PostgreSQL writes for a jsonb (no
    whitespace around the value): the decoder's C scanner alone, a quarter of what
    `json.loads` costs on a small payload (its type checks and whitespace regexes
    around the same scanner). Anything else, and every error, goes through
    `json.loads`, so what it raises is what `json.loads` raises."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


class Claims(GroupScope):
    """The claim path: lease ready rows to this member (with their messages), keep the
    leases alive, hand unstarted rows back, and take back expired leases."""

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
        statement = partial(claim_sql.claim, limit, ordered=self.ordered)
        started = time.monotonic()
        rows = self._lease(conn, statement, params)
        return self._claimed(rows, epoch, probe, started)

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
            run_hot(conn, claim_sql.postpone(), {**params, **lease_params(unseen)})
        return rows

    def _claimed(
        self, rows: Iterable[Any], epoch: int, probe: bool, claimed_at: float
    ) -> list[Claimed]:
        """The claimed rows as `Claimed` by a claim begun at `claimed_at`, filed under the
        later of `epoch` (what the caller's gate knows) and the epoch the claim saw in
        the database."""
        rows = list(rows)
        if rows:
            epoch = max(epoch, rows[0][_EPOCH] or 0)
        group, topic, loads = self.group, self.topic, _loads
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
                    Lease(r[_ID], r[_SEQ]),
                    r[_ATTEMPTS],
                    epoch,
                    probe,
                    None,
                    claimed_at,
                )
                for r in rows
            ]
        except (RecursionError, ValueError):  # written by another client: row by row
            return [self._claimed_carefully(r, epoch, probe, claimed_at) for r in rows]

    def _claimed_carefully(self, r: Any, epoch: int, probe: bool, claimed_at: float) -> Claimed:
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
        lease = Lease(r[_ID], r[_SEQ])
        return Claimed(message, lease, r[_ATTEMPTS], epoch, probe, unreadable, claimed_at)

    def extend(self, conn: Connection, leases: list[Lease]) -> set[Lease]:
        """Extend the given leases; returns those still held."""
        params = {"gid": self.gid, "member": self.member, "lease": self.lease}
        rows = run_hot(conn, claim_sql.extend_leases(), {**params, **lease_params(leases)})
        return lease_set(rows)

    def release(self, conn: Connection, leases: list[Lease]) -> set[Lease]:
        """Hand unstarted leased rows back to ready, uncharged; returns those released."""
        if not leases:
            return set()
        params = {"gid": self.gid, "member": self.member, **lease_params(leases)}
        released = lease_set(run_hot(conn, claim_sql.release(), params))
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
