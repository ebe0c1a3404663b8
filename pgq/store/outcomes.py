"""The outcomes `GroupStore` writes: what became of each attempt, fenced by its lease."""

from __future__ import annotations

from sqlalchemy import Connection

from pgq.records import (
    ErrorClass,
    Lease,
    Outcome,
    OutcomeKind,
    RowState,
)
from pgq.sql import locks as locks_sql
from pgq.sql import outcomes as outcome_sql
from pgq.store.connections import run_hot
from pgq.store.scope import GroupScope, lease_params, lease_set

ERROR_TEXT_MAX = 2000


def clean_text(text: str | None, limit: int = ERROR_TEXT_MAX) -> str:
    """Text the database accepts: NUL bytes and lone surrogates escaped, at most
    `limit` characters."""
    if not text:
        return ""
    text = text[:limit].replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _row_state(kind: OutcomeKind) -> RowState:
    """The state an outcome of `kind` leaves its row in: done, dead, or ready again
    (a retry or a snooze)."""
    if kind == OutcomeKind.DONE:
        return RowState.DONE
    if kind == OutcomeKind.DEAD:
        return RowState.DEAD
    return RowState.READY


class Outcomes(GroupScope):
    """The outcomes of this member's attempts, fenced by their leases: done, failed
    (retried or dead), snoozed (decision 0004)."""

    def record(self, conn: Connection, outcomes: list[Outcome]) -> set[Lease]:
        """Write a batch of outcomes (one statement per kind: successes, failures);
        returns the leases applied."""
        done = [o.claimed.lease for o in outcomes if o.kind == OutcomeKind.DONE]
        failed = [o for o in outcomes if o.kind != OutcomeKind.DONE]
        applied: set[Lease] = set()
        if done:
            params = {"gid": self.gid, "member": self.member, **lease_params(done)}
            applied |= lease_set(run_hot(conn, outcome_sql.ack_done(), params))
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
                "seconds": [o.seconds for o in failed],
            }
            applied |= lease_set(run_hot(conn, outcome_sql.record_failures(), params))
        return applied

    def end_backend(self, conn: Connection, pid: int) -> bool:
        """Terminate this role's server process `pid` (a transaction whose client gave
        it up); true when it was there."""
        return bool(conn.execute(locks_sql.end_backend(), {"pid": pid}).scalar())

    def backend_alive(self, conn: Connection, pid: int) -> bool:
        """Whether server process `pid` is still there (its transaction not ended)."""
        return bool(conn.execute(locks_sql.backend_alive(), {"pid": pid}).scalar())

    def settled(self, conn: Connection, outcomes: list[Outcome]) -> set[Lease]:
        """Of `outcomes` whose write was not seen to apply, the leases the database shows
        settled exactly as their outcome says (a write that committed but whose answer
        a cut connection lost): for successes the row gone (the ack deletes it) or
        marked done; for failures the state and the attempt count the outcome sets
        (an expiry sweep leaves the count alone), or for a group probe's systemic
        failure on a row dead at `max_attempts` that row dead, uncharged, of class
        systemic (`breaker_sql.probe_failed_dead`; a sweep kills of class `lease`). A
        success whose row another member reclaimed and finished after the cut counts
        as settled too: the message was done, and the reclaim explains the second run."""
        if not outcomes:
            return set()
        params = {"gid": self.gid, "ids": [o.claimed.id for o in outcomes]}
        rows = {r[0]: r for r in conn.execute(outcome_sql.settled(), params)}
        found: set[Lease] = set()
        for o in outcomes:
            row = rows.get(o.claimed.id)
            if row is None:
                if o.kind == OutcomeKind.DONE:
                    found.add(o.claimed.lease)
                continue
            _, seq, state, attempts, released, error_class = row
            if seq != o.claimed.seq or not released or state != _row_state(o.kind):
                continue
            charge = 0 if o.kind in (OutcomeKind.DONE, OutcomeKind.SNOOZE) else 1
            if o.kind == OutcomeKind.DONE or attempts == o.claimed.attempts + charge:
                found.add(o.claimed.lease)
            elif (
                o.kind == OutcomeKind.DEAD  # a probe's systemic failure of a dead row
                and attempts == o.claimed.attempts
                and error_class == ErrorClass.SYSTEMIC
            ):
                found.add(o.claimed.lease)
        return found
