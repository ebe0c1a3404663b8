"""`pgq web`: the dashboard (the `web` extra: Flask and waitress).

- `views`: what each page shows, read through `pgq.monitor` (no SQL here);
- `history`: the overview's charts, sampled in memory;
- `timeline`: the breaker timeline (spans, probes, closes) of a group page;
- `charts`: small SVG charts drawn on the server;
- `guard`: the admin token, sessions, CSRF and Host checks;
- `app`: routes, templates (`templates/`), errors, security headers;
- `server`: waitress and the sampler thread.

`dashboard_server` is what `pgq web` and `pgq demo --web` call.
"""

from __future__ import annotations

from sqlalchemy import Engine

from pgq.web.guard import MIN_TOKEN_LENGTH, TOKEN_ENV, Guard
from pgq.web.server import WebServer
from pgq.web.views import Dashboard, WebOptions

__all__ = [
    "MIN_TOKEN_LENGTH",
    "TOKEN_ENV",
    "Dashboard",
    "Guard",
    "WebOptions",
    "WebServer",
    "dashboard_server",
]


def dashboard_server(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    options: WebOptions | None = None,
) -> WebServer:
    """A bound (not yet serving) dashboard server over `engine`; admin when `token`."""
    return WebServer(Dashboard(engine, options or WebOptions()), Guard(token), host, port)
