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
from pgq.errors import DatabaseUnavailable, PgqError
from pgq.logcontext import get_logger
from pgq.records import Claimed, Outcome, OutcomeKind
from pgq.store import wrap_errors

logger = get_logger("pgq.consumer")


class HandlerEndedTransaction(PgqError):
    """A transactional handler asked to commit, roll back or close pgq's transaction."""


class Ended(enum.Enum):
    """How a transactional attempt ended."""

    COMMITTED = "committed"
    """Its `done` outcome committed with the handler's writes."""
    REFUSED = "refused"
    """The lease was lost: nothing written, everything rolled back."""
    FAILED = "failed"
    """The handler (or its writes, or the commit) failed: rolled back; the failure
    is for the acker to write."""
    UNKNOWN = "unknown"
    """The commit was sent and its answer lost with the connection: the row tells."""
    UNSTARTED = "unstarted"
    """No connection for the handler: it never ran; the row goes back, uncharged."""
    ABANDONED = "abandoned"
    """`proceed()` said no (the watchdog timed it out): rolled back, nothing to write."""


@dataclass(frozen=True)
class Attempt:
    """What became of a transactional attempt, with its outcome."""

    outcome: Outcome
    ended: Ended


class Transactions:
    """Runs a transactional handler on one row in a transaction of `engine`."""

    def __init__(self, engine: Engine, handling: Handling) -> None:
        self.engine = engine
        self.handling = handling

    def run(
        self,
        row: Claimed,
        write: Callable[[Connection], bool],
        proceed: Callable[[], bool] = lambda: True,
    ) -> Attempt:
        """Run the handler on `row` in a transaction; when it returns and `proceed()`
        (the attempt was not abandoned meanwhile), `write(conn)` writes the outcome
        in the same transaction (True: written) and the transaction commits. Never
        raises: a failure of the handler, of its writes or of the commit is the
        attempt's outcome."""
        handling = self.handling
        if row.unreadable is not None:
            return Attempt(handling.run(row), Ended.FAILED)
        try:
            with wrap_errors():
                conn = self.engine.connect()
        except PgqError as exc:  # no connection in `pool_timeout`, or none at all
            logger.warning(
                "no connection for a transactional handler id=%d error=%s"
                " (size the engine's pool for the workers); the row goes back unstarted",
                row.id,
                exc,
            )
            return Attempt(Outcome(row, OutcomeKind.DONE), Ended.UNSTARTED)
        with conn:
            guard = _Guard(conn)
            try:
                with wrap_errors():
                    conn.begin()
                handler: Callable[..., object] = handling.handler
                guard.armed = True
                try:
                    handler(row.message, conn)
                finally:
                    guard.armed = False
                guard.check()
            except BaseException as exc:  # a handler's SystemExit must not kill the thread
                guard.discard()
                return Attempt(handling.failure(row, guard.why(exc)), Ended.FAILED)
            done = Outcome(row, OutcomeKind.DONE)
            if not proceed():
                guard.discard()
                return Attempt(done, Ended.ABANDONED)
            try:
                with wrap_errors():
                    written = write(conn)
                if not written:
                    guard.discard()
                    return Attempt(done, Ended.REFUSED)
                guard.commit()
            except DatabaseUnavailable:
                if guard.sent:  # the commit may have happened
                    return Attempt(done, Ended.UNKNOWN)
                guard.discard()
                return Attempt(done, Ended.REFUSED)
            except PgqError as exc:  # a deferred constraint, a serialization failure
                guard.discard()
                return Attempt(handling.failure(row, exc), Ended.FAILED)
            return Attempt(done, Ended.COMMITTED)


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
