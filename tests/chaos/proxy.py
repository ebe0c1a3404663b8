"""A small TCP proxy between pgq members and PostgreSQL that breaks the network on command.

Hand a member `proxy.dsn(dsn)` instead of `dsn`: every connection it opens (the
pooled role connections, the fetcher's LISTEN connection, the prober's lock
connection, its member-session lock) then goes through the proxy, which can

- `cut()`: end every open connection at once, with a TCP reset (default) or a
  plain close; both ends see it (PostgreSQL ends the backend, so session locks go);
- `stall(seconds)`: stop forwarding in both directions for `seconds`, or until
  `resume()` (bytes wait in the kernel's buffers; nothing is lost or reordered);
- `refuse(seconds)`: reset every new connection for `seconds`, or until `allow()`;
- count connections: `accepted`, `open_connections`, `refused`, `wait_connections(n)`.

Loopback only, threads only: one accept thread and one thread per connection,
each blocked in `select` on its two sockets and a wake-up socket. `close()` (or
leaving the `with` block) ends every thread, bounded. Every fault is recorded in
`faults` with wall-clock times, for the history checker's explanations.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg

BUFFER = 256 * 1024
"""Bytes one direction holds before the proxy stops reading from its source."""

JOIN_TIMEOUT = 5.0
"""Seconds `close()` and `cut()` wait for a connection thread to end."""


@dataclass
class Fault:
    """One fault the proxy injected: `kind` is `cut`, `stall` or `refuse`; wall-clock
    times; `end` is None while it lasts (a stall or refusal until told otherwise)."""

    kind: str
    start: float
    end: float | None
    connections: int = 0

    def overlaps(self, start: float, end: float) -> bool:
        """Whether this fault touched the wall-clock window [start, end]."""
        last = self.end if self.end is not None else time.time()
        return self.start <= end and last >= start


def _reset(sock: socket.socket) -> None:
    """Close `sock` with a TCP reset (SO_LINGER 0) where it is a TCP socket."""
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Link:
    """One proxied connection: client <-> upstream, pumped by one thread."""

    def __init__(self, proxy: Proxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.wake_r, self.wake_w = socket.socketpair()
        self.cut_how: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-proxy-link", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def cut(self, how: str) -> None:
        self.cut_how = how
        self.wake()

    def _run(self) -> None:
        socks = (self.client, self.upstream)
        for sock in socks:
            sock.setblocking(False)
        other = {self.client: self.upstream, self.upstream: self.client}
        # pending[s]: bytes waiting to be written to s
        pending: dict[socket.socket, bytearray] = {s: bytearray() for s in socks}
        eof: set[socket.socket] = set()
        sel = selectors.DefaultSelector()
        sel.register(self.wake_r, selectors.EVENT_READ)
        masks: dict[socket.socket, int] = {}
        how = "close"
        try:
            while True:
                if self.proxy.closed:
                    break
                if self.cut_how is not None:
                    how = self.cut_how
                    break
                if eof and not any(pending[other[s]] for s in eof):
                    break  # one side ended and what it sent has been passed on
                stall = self.proxy.stall_remaining()
                for s in socks:
                    mask = 0
                    if stall is None:
                        if s not in eof and len(pending[other[s]]) < BUFFER:
                            mask |= selectors.EVENT_READ
                        if pending[s]:
                            mask |= selectors.EVENT_WRITE
                    if mask != masks.get(s, 0):
                        if masks.get(s, 0) == 0:
                            sel.register(s, mask)
                        elif mask == 0:
                            sel.unregister(s)
                        else:
                            sel.modify(s, mask)
                        masks[s] = mask
                timeout = 1.0 if stall is None else max(0.001, min(stall, 1.0))
                for key, mask in sel.select(timeout):
                    sock = key.fileobj
                    if sock is self.wake_r:
                        try:
                            self.wake_r.recv(4096)
                        except OSError:
                            pass
                        continue
                    assert isinstance(sock, socket.socket)
                    if mask & selectors.EVENT_READ:
                        data = sock.recv(65536)
                        if data:
                            pending[other[sock]] += data
                        else:
                            eof.add(sock)
                    if mask & selectors.EVENT_WRITE and pending[sock]:
                        sent = sock.send(pending[sock])
                        del pending[sock][:sent]
        except (OSError, ValueError):
            how = "rst"  # one side broke: pass the break on to the other
        finally:
            sel.close()
            for sock in socks:
                if how == "rst":
                    _reset(sock)
                else:
                    sock.close()
            self.wake_r.close()
            self.wake_w.close()
            self.proxy._forget(self)
            self.done.set()


class Proxy:
    """A TCP proxy from `127.0.0.1:<port>` to `upstream` (`(host, port)` or a Unix
    socket path). Use as a context manager; `dsn(original)` points a DSN at it."""

    def __init__(
        self, upstream: tuple[str, int] | str, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.upstream = upstream
        self.closed = False
        self.faults: list[Fault] = []
        self.accepted = 0
        self.refused = 0
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._stall_until: float | None = None  # monotonic; inf = until resume()
        self._stall_fault: Fault | None = None
        self._refuse_until: float | None = None
        self._refuse_fault: Fault | None = None
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.host, self.port = self._listener.getsockname()[:2]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="chaos-proxy-accept", daemon=True
        )
        self._acceptor.start()

    # -- construction from a DSN ------------------------------------------------

    @classmethod
    def for_dsn(cls, dsn: str) -> Proxy:
        """A proxy to the server `dsn` names (one host: TCP or a Unix socket directory)."""
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        host = str(params.get("hostaddr") or params.get("host") or "localhost")
        port = int(params.get("port") or 5432)
        if "," in host:
            raise ValueError(f"one host only, not {host!r}")
        if host.startswith("/"):
            return cls(f"{host}/.s.PGSQL.{port}")
        return cls((host, port))

    def dsn(self, dsn: str) -> str:
        """`dsn` with its host and port replaced by this proxy's (key=value form)."""
        params: dict[str, Any] = dict(psycopg.conninfo.conninfo_to_dict(dsn))
        params.pop("hostaddr", None)
        params["host"] = self.host
        params["port"] = str(self.port)
        return psycopg.conninfo.make_conninfo(**params)

    # -- faults -----------------------------------------------------------------

    def cut(self, how: str = "rst") -> int:
        """End every open connection now (`"rst"`: a TCP reset; `"close"`: FIN).

        Returns how many were cut; waits (bounded) until their threads ended.
        """
        if how not in ("rst", "close"):
            raise ValueError(f"how must be 'rst' or 'close', not {how!r}")
        with self._lock:
            links = list(self._links)
        now = time.time()
        for link in links:
            link.cut(how)
        for link in links:
            link.done.wait(JOIN_TIMEOUT)
        self.faults.append(Fault("cut", now, time.time(), len(links)))
        return len(links)

    def stall(self, seconds: float | None = None) -> None:
        """Stop forwarding on every connection, new ones included, for `seconds`
        (None: until `resume()`)."""
        now = time.time()
        with self._lock:
            self._stall_until = (
                float("inf") if seconds is None else time.monotonic() + float(seconds)
            )
            self._stall_fault = Fault(
                "stall", now, None if seconds is None else now + seconds, len(self._links)
            )
            self.faults.append(self._stall_fault)
        self._wake_all()

    def resume(self) -> None:
        """End a stall now; the connections carry on where they were."""
        with self._lock:
            self._stall_until = None
            if self._stall_fault is not None:
                end = self._stall_fault.end
                if end is None or end > time.time():
                    self._stall_fault.end = time.time()
            self._stall_fault = None
        self._wake_all()

    def stall_remaining(self) -> float | None:
        """Seconds the current stall still lasts (inf: until resumed), or None."""
        until = self._stall_until
        if until is None:
            return None
        remaining = until - time.monotonic()
        if remaining <= 0:
            with self._lock:
                if self._stall_until == until:
                    self._stall_until = None
            return None
        return remaining

    @property
    def stalled(self) -> bool:
        return self.stall_remaining() is not None

    def refuse(self, seconds: float | None = None) -> None:
        """Reset every new connection right after accepting it, for `seconds`
        (None: until `allow()`). Open connections carry on."""
        now = time.time()
        with self._lock:
            self._refuse_until = (
                float("inf") if seconds is None else time.monotonic() + float(seconds)
            )
            self._refuse_fault = Fault("refuse", now, None if seconds is None else now + seconds)
            self.faults.append(self._refuse_fault)

    def allow(self) -> None:
        """Accept new connections again."""
        with self._lock:
            self._refuse_until = None
            if self._refuse_fault is not None:
                end = self._refuse_fault.end
                if end is None or end > time.time():
                    self._refuse_fault.end = time.time()
            self._refuse_fault = None

    def refusing(self) -> bool:
        until = self._refuse_until
        return until is not None and time.monotonic() < until

    # -- counting -----------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._links)

    def wait_connections(self, n: int, timeout: float = 10.0) -> int:
        """Wait until at least `n` connections are open; returns how many are."""
        deadline = time.monotonic() + timeout
        while True:
            count = self.open_connections
            if count >= n:
                return count
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{count} connections open through the proxy after {timeout:g}s, wanted {n}"
                )
            time.sleep(0.02)

    # -- life cycle ----------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, end every connection, and wait (bounded) for every thread."""
        if self.closed:
            return
        self.closed = True
        self._acceptor.join(JOIN_TIMEOUT)
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.wake()
        for link in links:
            link.thread.join(JOIN_TIMEOUT)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def threads_alive(self) -> int:
        """Threads of this proxy still running (0 after `close()`)."""
        with self._lock:
            links = list(self._links)
        return sum(link.thread.is_alive() for link in links) + self._acceptor.is_alive()

    # -- internals ---------------------------------------------------------------------

    def _wake_all(self) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            link.wake()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        try:
            sock.connect(self.upstream)
        except OSError:
            sock.close()
            raise
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.closed:
                    return
                continue
            if self.closed:
                _reset(client)
                return
            if self.refusing():
                self.refused += 1
                _reset(client)
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                upstream = self._connect_upstream()
            except OSError:
                _reset(client)
                continue
            link = _Link(self, client, upstream)
            with self._lock:
                if self.closed:
                    _reset(client)
                    upstream.close()
                    return
                self._links.add(link)
                self.accepted += 1
            link.start()
