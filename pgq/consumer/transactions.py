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

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection, Engine

from pgq.consumer.handling import Handling
from pgq.errors import DatabaseUnavailable, HandlerEndedTransaction, PartialFailure, PgqError
from pgq.logcontext import get_logger
from pgq.records import Claimed, Lease, Outcome, OutcomeKind
from pgq.store import GroupStore, RoleConnection, wrap_errors
from pgq.store.transaction_guard import IDLE_AFTER_HANDLER_MIN, TransactionGuard

logger = get_logger("pgq.consumer")


BACKEND_GONE_WAIT = 30.0
"""Seconds to wait for the server process of a commit whose answer was lost to end,
before reading what the commit did."""


def commit_settled(
    conn: RoleConnection,
    store: GroupStore,
    done: list[Outcome],
    backend: int | None,
    stop: threading.Event,
) -> set[Lease]:
    """Of successes whose commit's answer was lost, those it committed. The server
    process the commit went to (`backend`) may still be running it (a slow trigger, a
    synchronous replica): it is ended, and waited for, before the rows can tell (gone,
    or done under this lease). Unknown for good (the database stays away, the process
    lingers): none counted done; a lease then expires and the message runs again if
    the commit did not happen."""
    try:
        if backend is not None:
            conn.retrying(store.end_backend, backend)
            deadline = time.monotonic() + BACKEND_GONE_WAIT
            while conn.retrying(store.backend_alive, backend):
                if time.monotonic() >= deadline or stop.wait(0.05):
                    logger.warning("commit unknown: backend %d still there", backend)
                    return set()
        return conn.retrying(store.settled, done)
    except PgqError as exc:
        logger.warning("commit unknown ids=%s error=%s", [o.claimed.id for o in done], exc)
        return set()


def unnamed(exc: PartialFailure, rows: list[Claimed]) -> TypeError:
    """What fails every row of a batch whose `PartialFailure` names none of its
    messages (empty, ids as text, another batch's ids): sending them all back
    uncharged would run the batch again at once, for ever, and never end it."""
    why = TypeError(
        f"PartialFailure named no message of its batch (named {list(exc.failures)[:5]!r};"
        f" the batch's ids {[row.id for row in rows][:5]!r}): the whole batch failed"
    )
    why.__cause__ = exc
    return why


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
    backend: int | None = None
    """UNKNOWN: the server process the commit went to (`settled_after` waits for it)."""


class Transactions:
    """Runs a transactional handler in a transaction of `engine`: on one row
    (`handler(msg, conn)`), or with `batch` on several (`batch_handler(msgs, conn)`)."""

    def __init__(self, engine: Engine, handling: Handling, *, batch: bool = False) -> None:
        self.engine = engine
        self.handling = handling
        self.batch = batch
        settings = handling.settings
        self.idle_ms = str(max(1, round(settings.handler_timeout * 1000)))
        """The transaction ends once idle that long while the handler runs (a paused
        member's must not hold its locks): no handler idles longer than
        `handler_timeout`, it is abandoned then."""
        self.closing_idle_ms = str(round(max(IDLE_AFTER_HANDLER_MIN, settings.lease) * 1000))

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
        """Run the handler on `rows` in one transaction (`_run_batch`); nothing escapes:
        an error past the handler's (a connection it broke) fails the rows."""
        asked: list[bool] = []

        def once() -> bool:
            if not asked:
                asked.append(proceed())
            return asked[0]

        try:
            return self._run_batch(rows, write, once)
        except BaseException as exc:  # a handler's SystemExit must not kill the thread
            if not once():
                return self._all([Outcome(row, OutcomeKind.DONE) for row in rows], Ended.ABANDONED)
            broken = HandlerEndedTransaction(
                f"pgq's transaction for the handler broke: {type(exc).__name__}: {exc}"
            )
            return [Attempt(self.handling.failure(row, broken), Ended.FAILED) for row in rows]

    def _run_batch(
        self,
        rows: list[Claimed],
        write: Callable[[Connection], set[Lease]],
        proceed: Callable[[], bool],
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
            guard = TransactionGuard(conn, self.closing_idle_ms)
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
                if guard.sent:  # the commit may have happened: the row tells, later
                    return [Attempt(o, Ended.UNKNOWN, guard.backend) for o in done]
                return self._all(done, Ended.RELEASED)  # the leases are still ours
            except PgqError as exc:  # a deferred constraint, a serialization failure
                guard.discard()
                return [Attempt(handling.failure(row, exc), Ended.FAILED) for row in rows]
            return self._all(done, Ended.COMMITTED)

    def _call(
        self, conn: Connection, guard: TransactionGuard, rows: list[Claimed]
    ) -> list[Attempt] | None:
        """The handler in a new transaction on `conn`: None when it returned, else
        what became of each row (its failure, or released for a `PartialFailure`
        that does not name it)."""
        handling = self.handling
        try:
            guard.begin(self.idle_ms)
            handler: Callable[..., object] = handling.handler
            with guard.handler_running():
                if self.batch:
                    handler([row.message for row in rows], conn)
                else:
                    handler(rows[0].message, conn)
            guard.check()
        except BaseException as exc:  # a handler's SystemExit must not kill the thread
            if isinstance(exc, PartialFailure) and guard.asked is None:
                failures = exc.failures
                if any(row.id in failures for row in rows):
                    return [
                        Attempt(handling.failure(row, failures[row.id]), Ended.FAILED)
                        if row.id in failures
                        else Attempt(Outcome(row, OutcomeKind.DONE), Ended.RELEASED)
                        for row in rows
                    ]
                exc = unnamed(exc, rows)
            why = guard.why(exc)
            return [Attempt(handling.failure(row, why), Ended.FAILED) for row in rows]
        return None

    @staticmethod
    def _all(done: list[Outcome], ended: Ended) -> list[Attempt]:
        return [Attempt(outcome, ended) for outcome in done]
