"""Attack: every loopback address is a client of its own to the token throttle.

`pgq web` listens on 127.0.0.1 by default, so who can reach it is on this
machine; and on Linux any process may connect from any address of
127.0.0.0/8, no privilege needed. `pgq.web.throttle.client_of` counts each
of those sixteen million addresses apart (an IPv6 address it counts by its
/64 because one host usually holds the whole /64: the same holds for 127/8),
so a local guesser gets five tries a minute per address, millions a minute in
all. A real server over real PostgreSQL; real sockets bound to 127.0.0.2,
127.0.0.3, ...
"""

from __future__ import annotations

import http.client
import urllib.parse

import pytest

pytest.importorskip("flask")

import test_web

ALICE = "alice-token-0123456789"

dead = test_web.dead
serve = test_web.serve
"""test_web's fixtures: group `g` with three dead rows; dashboard servers."""


def login_from(url: str, source: str, token: str) -> int:
    """The status of POST /login with `token` from a socket bound to `source`."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(
        parts.hostname, parts.port, timeout=30, source_address=(source, 0)
    )
    try:
        conn.request(
            "POST",
            "/login",
            body=urllib.parse.urlencode({"token": token}),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_guesses_from_many_loopback_addresses_are_throttled_as_one_client(engine, dead, serve):
    server = serve(users={"alice": ALICE})
    answers = [
        login_from(server.url, f"127.0.0.{n}", f"guess-guess-guess-{n}-{k}")
        for n in range(2, 12)
        for k in range(5)
    ]
    evaluated = answers.count(403)
    assert evaluated <= 5, (
        f"{evaluated} wrong tokens tried within a minute from this machine"
        f" ({len(answers)} sent from 10 loopback addresses): {answers}"
    )
