"""Serving the dashboard: waitress (threads, no async) plus the chart sampler.

`WebServer` binds at construction (so a taken port fails at once, as
`OSError`), serves on the caller's thread with `serve()` or on a
`pgq-web-server` thread with `start()`, and runs the `pgq-web-sampler`
thread while it serves. `close()` stops both, in an order that lets the
requests in flight finish and logs nothing: the loop thread stops accepting,
waitress's task threads drain, then the loop thread closes what is left (a
task thread that answered after the loop's pipe was closed made waitress log
`Bad file descriptor` tracebacks; docs/defects.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from waitress import wasyncore
from waitress.server import create_server

from pgq.web.app import MAX_BODY, create_app
from pgq.web.guard import Guard
from pgq.web.views import Dashboard

__all__ = ["WebServer"]

logger = logging.getLogger(__name__)

THREADS = 8
DRAIN_TIMEOUT = 5.0
"""Seconds `close()` waits for requests in flight."""

# one warning per request queued behind busy threads is noise, not news
logging.getLogger("waitress.queue").setLevel(logging.ERROR)


class WebServer:
    def __init__(self, dashboard: Dashboard, guard: Guard, host: str, port: int) -> None:
        self.dashboard = dashboard
        self._server: Any = create_server(
            create_app(dashboard, guard, host=host, port=port),
            host=host,
            port=port,
            threads=THREADS,
            ident="pgq",
            max_request_body_size=MAX_BODY,
            clear_untrusted_proxy_headers=True,
        )
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
