"""Transactional handlers: the handler's writes and the message's outcome commit
together (DESIGN §7, decision 0042).

`Consumer(engine, group, handler, transactional=True)` calls `handler(msg, conn)`
with a SQLAlchemy `Connection` of `engine` (the caller's pool: not one of the
member's three connections) inside a transaction pgq began. When the handler
returns, the outcome is written on that connection, fenced by the lease as every
outcome is, and the transaction commits: the effect and the acknowledgement are
one commit. A lease lost meanwhile (paused past it, reclaimed) writes nothing, and
the transaction rolls back: the handler's writes vanish with it and the message
runs where its lease went. A raise rolls the writes back and the failure is
recorded by the acker as for any handler.

The handler must not end pgq's transaction. A commit or rollback it asks for on
the connection is refused before it reaches the server (`HandlerEndedTransaction`
is raised in the handler), and whatever it does with the refusal, the attempt
fails and its writes are rolled back (the connection is thrown away: nothing of
it can be committed later). Savepoints (`conn.begin_nested()`) are the handler's
to use.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, event

from pgq.consumer.handling import Handling
from pgq.errors import DatabaseUnavailable, PartialFailure, PgqError
from pgq.logcontext import get_logger
from pgq.records import Claimed, Lease, Outcome, OutcomeKind
from pgq.store import wrap_errors

logger = get_logger("pgq.consumer")


class HandlerEndedTransaction(PgqError):
    """A transactional handler asked to commit, roll back or close pgq's transaction."""


class Ended(enum.Enum):
    """How a transactional attempt ended, for one of its rows."""

    COMMITTED = "committed"
    """Its `done` outcome committed with the handler's writes."""
    REFUSED = "refused"
    """Its lease was lost: nothing written, everything rolled back."""
    FAILED = "failed"
    """The handler (or its writes, or the commit) failed it: rolled back; the failure
    is for the acker to write."""
    RELEASED = "released"
    """Rolled back without a failure of its own (no connection for the handler,
    another row's lost lease, a `PartialFailure` naming other rows): back to ready,
    uncharged."""
    UNKNOWN = "unknown"
    """The commit was sent and its answer lost with the connection: the row tells."""
    ABANDONED = "abandoned"
    """`proceed()` said no (the watchdog timed it out): rolled back, nothing to write."""


@dataclass(frozen=True)
class Attempt:
    """What became of one row of a transactional attempt, with its outcome."""

    outcome: Outcome
    ended: Ended


class Transactions:
    """Runs a transactional handler in a transaction of `engine`: on one row
    (`handler(msg, conn)`), or with `batch` on several (`batch_handler(msgs, conn)`)."""

    def __init__(self, engine: Engine, handling: Handling, *, batch: bool = False) -> None:
        self.engine = engine
        self.handling = handling
        self.batch = batch

    def run(
        self,
        row: Claimed,
        write: Callable[[Connection], bool],
        proceed: Callable[[], bool] = lambda: True,
    ) -> Attempt:
        """`run_batch` of one row (a worker's, or the prober's probe); `write(conn)`
        says whether it wrote the row's outcome."""
        lease = row.lease
        [attempt] = self.run_batch([row], lambda conn: {lease} if write(conn) else set(), proceed)
        return attempt

    def run_batch(
        self,
        rows: list[Claimed],
        write: Callable[[Connection], set[Lease]],
        proceed: Callable[[], bool] = lambda: True,
    ) -> list[Attempt]:
        """Run the handler on `rows` in one transaction; when it returns, `write(conn)`
        writes their `done` outcomes in it (the leases applied) and, all applied, the
        transaction commits. `proceed()` is asked once the handler is over, whatever
        it did: False (the attempt was abandoned) rolls everything back and reports
        nothing. Never raises: what failed is in the attempts, one per row in order."""
        handling = self.handling
        done = [Outcome(row, OutcomeKind.DONE) for row in rows]
        if any(row.unreadable is not None for row in rows):  # never given to the handler
            if not proceed():
                return self._all(done, Ended.ABANDONED)
            return [
                Attempt(handling.run(row), Ended.FAILED)  # dead at once
                if row.unreadable is not None
                else Attempt(outcome, Ended.RELEASED)
                for row, outcome in zip(rows, done, strict=True)
            ]
        try:
            with wrap_errors():
                conn = self.engine.connect()
        except PgqError as exc:  # no connection in `pool_timeout`, or none at all
            logger.warning(
                "no connection for a transactional handler ids=%s error=%s"
                " (size the engine's pool for the workers); the rows go back unstarted",
                [row.id for row in rows][:20],
                exc,
            )
            return self._all(done, Ended.RELEASED if proceed() else Ended.ABANDONED)
        with conn:
            guard = _Guard(conn)
            failed = self._call(conn, guard, rows)
            if not proceed():
                guard.discard()
                return self._all(done, Ended.ABANDONED)
            if failed is not None:
                guard.discard()
                return failed
            try:
                with wrap_errors():
                    applied = write(conn)
                if len(applied) < len(rows):
                    guard.discard()
                    return [
                        Attempt(o, Ended.RELEASED if o.claimed.lease in applied else Ended.REFUSED)
                        for o in done
                    ]
                guard.commit()
            except DatabaseUnavailable:
                guard.discard()
                # sent, the commit may have happened; else the leases are still ours
                return self._all(done, Ended.UNKNOWN if guard.sent else Ended.RELEASED)
            except PgqError as exc:  # a deferred constraint, a serialization failure
                guard.discard()
                return [Attempt(handling.failure(row, exc), Ended.FAILED) for row in rows]
            return self._all(done, Ended.COMMITTED)

    def _call(self, conn: Connection, guard: _Guard, rows: list[Claimed]) -> list[Attempt] | None:
        """The handler in a new transaction on `conn`: None when it returned, else
        what became of each row (its failure, or released for a `PartialFailure`
        that does not name it)."""
        handling = self.handling
        try:
            with wrap_errors():
                conn.begin()
            handler: Callable[..., object] = handling.handler
            guard.armed = True
            try:
                if self.batch:
                    handler([row.message for row in rows], conn)
                else:
                    handler(rows[0].message, conn)
            finally:
                guard.armed = False
            guard.check()
        except BaseException as exc:  # a handler's SystemExit must not kill the thread
            if isinstance(exc, PartialFailure) and guard.asked is None:
                failures = exc.failures
                return [
                    Attempt(handling.failure(row, failures[row.id]), Ended.FAILED)
                    if row.id in failures
                    else Attempt(Outcome(row, OutcomeKind.DONE), Ended.RELEASED)
                    for row in rows
                ]
            why = guard.why(exc)
            return [Attempt(handling.failure(row, why), Ended.FAILED) for row in rows]
        return None

    @staticmethod
    def _all(done: list[Outcome], ended: Ended) -> list[Attempt]:
        return [Attempt(outcome, ended) for outcome in done]


class _Guard:
    """Keeps a handler from ending pgq's transaction while it runs (`armed`)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.armed = False
        self.asked: str | None = None
        self.sent = False
        event.listen(conn, "commit", functools.partial(self._refuse, "commit"))
        event.listen(conn, "rollback", functools.partial(self._refuse, "roll back"))

    def _refuse(self, what: str, conn: Connection) -> None:
        if self.armed:
            self.asked = self.asked or what
            raise self._ended()

    def _ended(self) -> HandlerEndedTransaction:
        return HandlerEndedTransaction(
            f"a transactional handler must not {self.asked or 'close'} pgq's transaction or"
            " its connection (pgq commits the handler's writes with the message's outcome;"
            " raise to fail the attempt): its writes were rolled back"
        )

    def why(self, exc: BaseException) -> BaseException:
        """What failed the attempt: the handler's ending of the transaction, if it
        tried, whatever it raised after."""
        return self._ended() if self.asked is not None else exc

    def check(self) -> None:
        """After the handler returned: raise if it tried to end the transaction,
        closed the connection, or left pgq's transaction otherwise."""
        conn = self.conn
        if self.asked is not None or conn.closed or not conn.in_transaction():
            raise self._ended()

    def commit(self) -> None:
        """Commit for pgq. `sent` says whether the COMMIT went out: when it raises
        `DatabaseUnavailable` after that, the commit may have happened."""
        self.ours = True
        try:
            with wrap_errors():
                self.sent = True
                self.conn.commit()
        finally:
            self.ours = False

    def discard(self) -> None:
        """Roll everything back. After the handler tried to end the transaction the
        connection is thrown away (the server rolls back what it had), so nothing it
        left half-ended can reach a later commit; otherwise a plain rollback keeps
        the pooled connection."""
        conn = self.conn
        if self.asked is None and not conn.closed:
            try:
                conn.rollback()
                return
            except Exception:  # a broken connection: thrown away below
                pass
        with contextlib.suppress(Exception):
            conn.invalidate()
