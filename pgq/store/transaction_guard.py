"""The database side of a transactional handler's attempt (`pgq.consumer.transactions`):
begin pgq's transaction on the caller's connection, keep the handler from ending it,
tell afterwards whether it is still pgq's, and commit it for pgq.
"""

from __future__ import annotations

import contextlib
import functools
import re
import secrets
from collections.abc import Iterator

import psycopg
from sqlalchemy import Connection, event

from pgq.errors import HandlerEndedTransaction
from pgq.logcontext import get_logger
from pgq.sql import locks as locks_sql
from pgq.store.errors import wrap_errors

logger = get_logger("pgq.consumer")

IDLE_AFTER_HANDLER_MIN = 5.0
"""The least time the transaction may stay idle between the handler's return and the
commit (the lease, but no less, as a member's own sessions)."""

TRANSACTION_CONTROL = re.compile(
    r"\s*(COMMIT|END|ABORT|BEGIN|START|PREPARE|ROLLBACK(?!\s+(WORK\s+|TRANSACTION\s+)?TO\b))\b",
    re.IGNORECASE,
)
"""A statement that would end or begin a transaction (a savepoint's are the handler's)."""

MARKER = "pgq.attempt"
"""A setting pgq sets for the transaction alone (`set_config(..., true)`): still there
after the handler, the transaction is still pgq's."""


class TransactionGuard:
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
