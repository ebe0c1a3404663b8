"""Plumbing for the `web_*` attacks: a dashboard server on an attack schema, and raw
HTTP requests (`http.client`, so a script sets any header, `Host` included).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from _common import Schema

from pgq.web import WebOptions, dashboard_server

TOKEN = "attack-token-0123456789abcdef"


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: str

    def header(self, name: str) -> str:
        return self.headers.get(name) or ""


def request(
    url: str,
    method: str,
    path: str,
    *,
    form: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> Answer:
    """One request to the server at `url` (`http://host:port/`)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        body = urllib.parse.urlencode(form) if form is not None else None
        hdrs = dict(headers or {})
        if body is not None:
            hdrs.setdefault("Content-Type", "application/x-www-form-urlencoded")
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return Answer(resp.status, resp.headers, resp.read().decode("utf-8", "replace"))
    finally:
        conn.close()


@contextlib.contextmanager
def dashboard(s: Schema, token: str | None = None, **options: Any) -> Iterator[Any]:
    """A started dashboard server over `s` on 127.0.0.1 and a free port."""
    server = dashboard_server(
        s.engine, host="127.0.0.1", port=0, token=token, options=WebOptions(**options)
    )
    server.start()
    try:
        yield server
    finally:
        server.close()


def login(url: str, token: str = TOKEN) -> str:
    """The session cookie (`pgq_session=...`, for a `Cookie` header) a login with
    `token` sets, or "" when it sets none."""
    answer = request(url, "POST", "/login", form={"token": token})
    return answer.header("Set-Cookie").split(";", 1)[0]


def csrf_of(url: str, cookie: str, group: str) -> str:
    """The CSRF token in `group`'s page for the session `cookie`."""
    page = request(url, "GET", f"/groups/{group}", headers={"Cookie": cookie}).body
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    return found.group(1) if found else ""
