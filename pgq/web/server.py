"""Serving the dashboard: waitress (threads, no async) plus the chart sampler.

`WebServer` binds at construction (so a taken port fails at once, as
`OSError`), serves on the caller's thread with `serve()` or on a
`pgq-web-server` thread with `start()`, and runs the `pgq-web-sampler`
thread while it serves. `close()` stops both, in an order that lets the
requests in flight finish and logs nothing: the loop thread stops accepting,
waitress's task threads drain, then the loop thread closes what is left (a
task thread that answered after the loop's pipe was closed made waitress log
`Bad file descriptor` tracebacks; docs/defects.md).

Slow and idle clients cannot starve it (`Limits`): waitress stops accepting at
its connection limit and, by default, closes an idle connection only after
120 s and a request that trickles in never (every byte resets its timer), so
a hundred sockets that sent nothing locked everyone out, `/healthz` included.
Here each connection is checked every turn of the loop (`GuardedChannel`)
against `Limits.overdue`: idle too long, or a request that has not arrived
whole within its deadline, is closed; when the server is crowded, both
deadlines shrink, so idle and slow sockets go first.

Nor can clients that do not read their answers: waitress's task thread writes
an answer into the connection's buffer and, past `outbuf_high_watermark`
(16 MB; pipelined requests for a big page fill it from one read), waits until
the client reads, holding the thread for as long as the client likes. A thread
may wait for its client's reading `Limits.request` seconds in all (a browser
never makes it wait: no page is near 16 MB); then the connection is closed,
which wakes the thread (`ClientDisconnected`: it ends that answer and takes
the next task).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer, create_server

from pgq.web.app import MAX_BODY, create_app
from pgq.web.guard import Guard
from pgq.web.views import Dashboard

__all__ = ["GuardedChannel", "Limits", "WebServer"]

logger = logging.getLogger(__name__)

THREADS = 8
DRAIN_TIMEOUT = 5.0
"""Seconds `close()` waits for requests in flight."""

# one warning per request queued behind busy threads is noise, not news
logging.getLogger("waitress.queue").setLevel(logging.ERROR)


@dataclass(frozen=True, slots=True)
class Limits:
    """How many connections the dashboard holds and how long a client may keep one
    without using it (seconds)."""

    connections: int = 500
    """Open connections at most (waitress's default is 100); past it the server stops
    accepting until one closes. Each takes a file descriptor."""
    idle: float = 30.0
    """A connection with no request in it and no bytes moving is closed after this."""
    request: float = 10.0
    """A request must arrive whole (headers and body) within this of its first byte; a
    task thread may wait this long in all for the client to read its answers."""
    crowded: float = 0.75
    """From this share of `connections` on, the server is crowded: then"""
    crowded_idle: float = 1.0
    """idle connections are closed after this, and"""
    crowded_request: float = 2.0
    """requests must arrive whole (and threads stop waiting for readers) within this."""

    def overdue(
        self,
        *,
        now: float,
        last_activity: float,
        started: float | None,
        busy: bool,
        open_connections: int,
        waited: float = 0.0,
    ) -> bool:
        """Whether to close a connection: its last byte in or out at `last_activity`,
        the request it is receiving begun at `started` (None: between requests),
        `busy` while a request of it is being answered (then closed only when a
        thread has `waited` too long in all for the client to read its answers:
        the answer's database reads have their own deadline)."""
        crowded = open_connections >= self.connections * self.crowded
        if busy:
            return waited > (self.crowded_request if crowded else self.request)
        if started is not None:
            return now - started > (self.crowded_request if crowded else self.request)
        return now - last_activity > (self.crowded_idle if crowded else self.idle)


class GuardedChannel(HTTPChannel):  # type: ignore[misc]
    """waitress's connection, closed when `Limits.overdue` says so. The loop calls
    `readable()` on every connection at least once a second (its poll timeout),
    which is where it is checked, and where the time a task thread waits for
    this client to read (its output past the high watermark) is added up.
    Times are waitress's (`time.time`), so they compare with its
    `last_activity`. An overdue connection is closed there and then: one whose
    client does not read is never writable, so waitress's `will_close` (acted
    on when writable) would never close it."""

    requests: list[Any]  # waitress's: the requests received and not yet answered
    total_outbufs_len: int  # waitress's: bytes buffered for the client
    adj: Any  # waitress's settings

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        self.limits = limits
        self.started: float | None = None  # first byte of the request being received
        self.waited = 0.0  # seconds a task thread has waited for this client to read
        self._waiting_since: float | None = None
        self.dropped = False
        super().__init__(*args, **kwargs)

    def received(self, data: bytes) -> bool:
        before = self.request
        result: bool = super().received(data)
        if self.request is None:
            self.started = None
        elif self.request is not before:
            self.started = time.time()
        return result

    def readable(self) -> bool:
        if self.dropped:
            return False
        now = time.time()
        busy = bool(self.requests)
        if busy and self.total_outbufs_len > self.adj.outbuf_high_watermark:
            # a task thread waits (or will, at its next write) for the client to read
            if self._waiting_since is not None:
                self.waited += now - self._waiting_since
            self._waiting_since = now
        else:
            self._waiting_since = None
        if self.limits.overdue(
            now=now,
            last_activity=self.last_activity,
            started=self.started,
            busy=busy,
            open_connections=len(self._map),
            waited=self.waited,
        ):
            self.dropped = True
            self.handle_close()  # wakes a waiting task thread: ClientDisconnected
            return False
        readable: bool = super().readable()
        return readable

    def writable(self) -> bool:
        if self.dropped:
            return False
        writable: bool = super().writable()
        return writable


class WebServer:
    def __init__(
        self,
        dashboard: Dashboard,
        guard: Guard,
        host: str,
        port: int,
        limits: Limits | None = None,
    ) -> None:
        self.dashboard = dashboard
        limits = limits or Limits()
        self._server: Any = create_server(
            create_app(dashboard, guard, host=host, port=port),
            host=host,
            port=port,
            threads=THREADS,
            ident="pgq",
            max_request_body_size=MAX_BODY,
            clear_untrusted_proxy_headers=True,
            connection_limit=limits.connections,
            channel_timeout=math.ceil(limits.idle),
        )
        # the listening socket makes GuardedChannels (`create_server` takes no class)
        for listener in list(self._server._map.values()):
            if isinstance(listener, BaseWSGIServer):
                listener.channel_class = functools.partial(GuardedChannel, limits=limits)
        self.host = host
        self.port = int(self._server.effective_port)
        self.admin = guard.admin
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # a port of 0 means "any": the Host check has to know the real one
        if port == 0:
            self._server.application = create_app(dashboard, guard, host=host, port=self.port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def _sampler(self) -> None:
        t = threading.Thread(
            target=self.dashboard.run_sampler, args=(self._stop,), name="pgq-web-sampler"
        )
        t.daemon = True
        t.start()
        self._threads.append(t)

    def serve(self) -> None:
        """Serve on this thread until `close()` (or KeyboardInterrupt)."""
        self._sampler()
        logger.info("web serving url=%s admin=%s", self.url, self.admin)
        try:
            self._server.run()
        finally:
            self.close()

    def start(self) -> None:
        """Serve on a `pgq-web-server` thread."""
        t = threading.Thread(target=self.serve, name="pgq-web-server", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        server = self._server
        serving = any(t.name == "pgq-web-server" and t.is_alive() for t in self._threads)
        if not serving or threading.current_thread().name == "pgq-web-server":
            server.task_dispatcher.shutdown(timeout=DRAIN_TIMEOUT)
            self.dashboard.close()
            wasyncore.close_all(server._map)
            return
        self._in_loop(lambda: wasyncore.dispatcher.close(server))  # stop accepting
        server.task_dispatcher.shutdown(timeout=DRAIN_TIMEOUT)
        self.dashboard.close()  # after the requests: none of them finds the readers gone
        self._in_loop(lambda: wasyncore.close_all(server._map))
        for t in self._threads:
            t.join(timeout=DRAIN_TIMEOUT)

    def _in_loop(self, thunk: Any) -> None:
        """Run `thunk` on the loop thread (waitress's trigger); a trigger already closed
        means the loop has closed everything itself."""
        try:
            self._server.trigger.pull_trigger(thunk)
        except OSError:
            pass
