"""`pgq web`: the dashboard (the `web` extra: Flask and waitress).

- `views`: what each page shows, read through `pgq.monitor` (no SQL here);
- `timeline`: the breaker timeline (spans, probes, closes) of a group page;
- `charts`: SVG charts drawn on the server: the overview's sparklines, the group
  page's charts with axes (from the samples the database keeps, decision 0045);
- `guard`: who may change things: sessions, CSRF and Host checks;
- `tokens`: the admin tokens, one per person, and their strength rule;
- `throttle`: failed token attempts, limited per client;
- `app`: routes, templates (`templates/`), errors, security headers;
- `server`: waitress and the sampler thread.

`dashboard_server` is what `pgq web` and `pgq demo --web` call.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Engine

from pgq.web.guard import Guard
from pgq.web.server import Limits, WebServer
from pgq.web.tokens import (
    MIN_TOKEN_LENGTH,
    TOKEN_ENV,
    TOKENS_ENV,
    TOKENS_FILE_ENV,
    admin_tokens,
)
from pgq.web.views import Dashboard, WebOptions

__all__ = [
    "MIN_TOKEN_LENGTH",
    "TOKENS_ENV",
    "TOKENS_FILE_ENV",
    "TOKEN_ENV",
    "Dashboard",
    "Guard",
    "Limits",
    "WebOptions",
    "WebServer",
    "admin_tokens",
    "dashboard_server",
]


def dashboard_server(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    options: WebOptions | None = None,
    users: Mapping[str, str] | None = None,
) -> WebServer:
    """A bound (not yet serving) dashboard server over `engine`; admin with `users`
    (person -> token) or `token` (the person `admin`'s)."""
    guard = Guard(users if users is not None else token)
    return WebServer(Dashboard(engine, options or WebOptions()), guard, host, port)
