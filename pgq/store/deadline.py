"""Reads that end when their deadline does: `ReadDeadline`.

A statement waiting on a connection that stopped answering (a blackholed
route, a virtual IP moved to a new primary, a hung backend) cannot be ended
through the server: a cancel request may reach it, but the answer never comes
back on the dead connection, and libpq waits for as long as TCP keeps the
socket (~15 minutes of retransmissions; forever for a stopped backend whose
kernel still acknowledges). `ReadDeadline` runs each read on one of its
threads, over an engine of its own; when the caller's deadline passes it shuts
that read's socket down from the caller's thread. The blocked read then fails
at once, its connection is discarded, and the thread is free for the next
read (docs/defects.md, hung pool connections). The dashboard (`pgq web`) reads
this way.

The engine has no pre-ping: a ping runs before a connection is handed out,
where no deadline could reach it; a connection the server closed meanwhile
fails its first read instead, and the pool replaces it.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from sqlalchemy import Engine, event

from pgq.errors import DatabaseUnavailable
from pgq.store.engine import connect, conninfo_of, schema_of

__all__ = ["ReadDeadline"]

T = TypeVar("T")


class ReadDeadline:
    """`run(timeout, read, *args)`: `read(engine, *args)` on one of `threads` reader
    threads, ended (`DatabaseUnavailable`) after `timeout` seconds."""

    def __init__(self, engine: Engine, threads: int, name: str) -> None:
        self.engine = connect(
            conninfo_of(engine), schema=schema_of(engine), pool_size=threads, pool_pre_ping=False
        )
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        # reader thread -> the socket of the connection it holds: (fd, inode)
        self._sockets: dict[int, tuple[int, int]] = {}
        event.listen(self.engine, "checkout", self._checkout)
        event.listen(self.engine, "checkin", self._checkin)

    def _checkout(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        fd = dbapi_connection.pgconn.socket
        with self._lock:
            self._sockets[threading.get_ident()] = (fd, os.fstat(fd).st_ino)

    def _checkin(self, dbapi_connection: Any, record: Any) -> None:
        with self._lock:
            self._sockets.pop(threading.get_ident(), None)

    def run(self, timeout: float, read: Callable[..., T], *args: Any) -> T:
        reader: list[int] = []

        def on_reader() -> T:
            reader.append(threading.get_ident())
            return read(self.engine, *args)

        try:
            future = self._readers.submit(on_reader)
        except RuntimeError:  # closed: the readers take no more reads
            raise DatabaseUnavailable("the reads are closed") from None
        try:
            return future.result(timeout=timeout)
        except CancelledError:  # `close()` dropped it before a reader took it
            raise DatabaseUnavailable("the read was ended: the reads are closing") from None
        except FutureTimeout:
            if not future.cancel() and reader:
                self._cut(reader[0])
            raise DatabaseUnavailable(f"the database did not answer within {timeout:g} s") from None

    def _cut(self, reader: int) -> None:
        """Shut down the socket `reader` reads from, if it still holds that one."""
        with self._lock:
            held = self._sockets.pop(reader, None)
            if held is None:
                return
            fd, inode = held
            try:
                dup = os.dup(fd)
            except OSError:
                return  # closed meanwhile
            try:
                if os.fstat(dup).st_ino == inode:  # the same socket, not a reused number
                    sock = socket.socket(fileno=dup)
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    finally:
                        sock.detach()
            except OSError:
                pass
            finally:
                os.close(dup)

    def close(self) -> None:
        """End the reads in flight, stop the readers, close the engine's connections."""
        with self._lock:
            readers = list(self._sockets)
        for reader in readers:
            self._cut(reader)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self.engine.dispose()
