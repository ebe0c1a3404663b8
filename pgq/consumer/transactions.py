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
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
from sqlalchemy import Connection, Engine, event

from pgq.consumer.handling import Handling
from pgq.errors import DatabaseUnavailable, PartialFailure, PgqError
from pgq.logcontext import get_logger
from pgq.records import Claimed, Lease, Outcome, OutcomeKind
from pgq.sql import locks as locks_sql
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
            guard = _Guard(conn, self.closing_idle_ms)
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

    def _call(self, conn: Connection, guard: _Guard, rows: list[Claimed]) -> list[Attempt] | None:
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


TRANSACTION_CONTROL = re.compile(
    r"\s*(COMMIT|END|ABORT|BEGIN|START|PREPARE|ROLLBACK(?!\s+(WORK\s+|TRANSACTION\s+)?TO\b))\b",
    re.IGNORECASE,
)
"""A statement that would end or begin a transaction (a savepoint's are the handler's)."""

IDLE_AFTER_HANDLER_MIN = 5.0
"""The least time the transaction may stay idle between the handler's return and the
commit (the lease, but no less, as a member's own sessions)."""

MARKER = "pgq.attempt"
"""A setting pgq sets for the transaction alone (`set_config(..., true)`): still there
after the handler, the transaction is still pgq's."""


class _Guard:
    """Keeps a handler from ending pgq's transaction while it runs (`armed`): through
    SQLAlchemy (`commit()`, `rollback()`), through the driver's connection, or with a
    statement; and tells afterwards whether the transaction is still pgq's."""

    def __init__(self, conn: Connection, closing_idle_ms: str) -> None:
        self.conn = conn
        self.closing_idle_ms = closing_idle_ms
        """From the handler's return to the commit, the transaction holds the ack's row
        locks: a member paused there holds them this long at most (the lease)."""
        self.armed = False
        self.asked: str | None = None
        self.sent = False
        self.token = secrets.token_hex(8)
        driver = conn.connection.driver_connection
        self.driver = driver if isinstance(driver, psycopg.Connection) else None
        self.backend = self.driver.info.backend_pid if self.driver is not None else None
        """The server process of the transaction: after a commit whose answer was lost,
        what to wait for before the row can tell what happened."""
        event.listen(conn, "commit", functools.partial(self._refuse, "commit"))
        event.listen(conn, "rollback", self._rolled_back)
        event.listen(conn, "before_cursor_execute", self._statement)

    def begin(self, idle_ms: str) -> None:
        """Begin pgq's transaction, mark it as pgq's, and have the server end it once
        idle in it for `idle_ms` milliseconds."""
        with wrap_errors():
            self.conn.begin()
            marks = {"name": MARKER, "value": self.token, "idle_ms": idle_ms}
            self.conn.execute(locks_sql.mark_transaction(), marks)

    @contextlib.contextmanager
    def handler_running(self) -> Iterator[None]:
        """While the handler runs, a commit is refused before it reaches the server,
        however asked for (SQLAlchemy, the driver, a statement): it would make the
        writes durable without their ack. A rollback or a close is let through (it
        only loses writes) and noted: the attempt then fails (`check`)."""
        driver = self.driver
        self.armed = True
        if driver is not None:
            driver.commit = functools.partial(self._refuse, "commit")  # type: ignore[method-assign]
        try:
            yield
        finally:
            self.armed = False
            if driver is not None:
                with contextlib.suppress(AttributeError):
                    del driver.commit

    def _refuse(self, what: str, *_: object) -> None:
        if self.armed:
            self.asked = self.asked or what
            raise self._ended()

    def _rolled_back(self, conn: Connection) -> None:
        if self.armed:
            self.asked = self.asked or "roll back"

    def _statement(self, conn: Connection, cursor: object, statement: str, *_: object) -> None:
        if self.armed and TRANSACTION_CONTROL.match(statement):
            self._refuse(statement.split(None, 1)[0].lower())

    def _ended(self) -> HandlerEndedTransaction:
        return HandlerEndedTransaction(
            f"a transactional handler must not {self.asked or 'end'} pgq's transaction or"
            " its connection (pgq commits the handler's writes with the message's outcome;"
            " raise to fail the attempt): its writes were rolled back"
        )

    def why(self, exc: BaseException) -> BaseException:
        """What failed the attempt: the handler's ending of the transaction, if it
        tried, whatever it raised after."""
        return self._ended() if self.asked is not None else exc

    def check(self) -> None:
        """After the handler returned: raise if it tried to end the transaction,
        closed the connection, or left pgq's transaction by any other way (the
        marker pgq set for the transaction is gone)."""
        conn = self.conn
        driver = self.driver
        if conn.invalidated or (driver is not None and driver.closed):
            self.asked = self.asked or "break"  # invalidated, or its driver's closed
        if self.asked is not None or conn.closed or not conn.in_transaction():
            raise self._ended()
        marks = {"name": MARKER, "idle_ms": self.closing_idle_ms}
        with wrap_errors():
            marked = conn.execute(locks_sql.transaction_marked(), marks).first()
        marker = None if marked is None else marked[0]
        if marker != self.token:
            logger.error(
                "a transactional handler ended pgq's transaction behind its back"
                " (a COMMIT or ROLLBACK sent by other means): what it committed before"
                " is not undone"
            )
            self.asked = "end"
            raise self._ended()

    def commit(self) -> None:
        """Commit for pgq. `sent` says whether the COMMIT went out: when it raises
        `DatabaseUnavailable` after that, the commit may have happened."""
        with wrap_errors():
            self.sent = True
            self.conn.commit()

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
