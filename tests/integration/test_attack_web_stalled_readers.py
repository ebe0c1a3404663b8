"""Attack: clients that ask for a big page and never read the answer hold every
waitress thread for good, `/healthz` included.

waitress answers into the connection's buffer; past `outbuf_high_watermark`
(16 MB) the task thread waits until the client reads. A client that never
reads (zero receive window) makes it wait for ever: `Limits.overdue` never
closes a connection that is `busy`, and waitress's own idle check skips it
too; a client that reads a trickle (1 kB every 0.2 s) is not idle either,
and holds its thread as long. Pipelined requests for a 1 MB page (a message with a 500 kB payload; a
group page with 200 dead rows is 100 kB) fill 16 MB from one 8 kB read; one
such socket per thread (eight) and the dashboard answers nobody again until
the attackers go away. Real sockets against a real server over real
PostgreSQL; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

import pgq

pytest.importorskip("flask")

from pgq.web import Dashboard, Guard, WebOptions, WebServer
from pgq.web.server import THREADS, Limits

ANSWER_WITHIN = 10.0
"""Seconds `/healthz` gets to answer while the readers stall."""
LIMITS = Limits(idle=2.0, request=2.0)
"""Short deadlines, so that a connection whose answer has not moved for `idle`
could be dropped well within the test."""
PIPELINED = 40
"""Requests each attacker sends at once (about 2.5 kB: one read of waitress's)."""


def healthz(url: str) -> tuple[int | str, float]:
    parts = urllib.parse.urlsplit(url)
    began = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=ANSWER_WITHIN)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - began
    except OSError as exc:
        return repr(exc), time.monotonic() - began
    finally:
        conn.close()


@contextlib.contextmanager
def slow_readers(url: str, path: str, count: int, trickle: bool) -> Iterator[None]:
    """`count` sockets that each send `PIPELINED` GETs of `path`, then never read
    (`trickle` False) or read 1 kB every 0.2 s, forever (`trickle`: every byte the
    server sends is progress)."""
    parts = urllib.parse.urlsplit(url)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode() * PIPELINED
    socks: list[socket.socket] = []
    stop = threading.Event()

    def read_slowly(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.wait(0.2) and s.recv(1024):
                pass

    readers = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window
            s.settimeout(5)
            s.connect((parts.hostname, parts.port))
            s.sendall(request)
            socks.append(s)
            if trickle:
                readers.append(threading.Thread(target=read_slowly, args=(s,), daemon=True))
                readers[-1].start()
        yield
    finally:
        stop.set()
        for th in readers:
            th.join(10)
        for s in socks:
            s.close()


def stalled_answers(server: WebServer) -> int:
    """Connections whose answer waits, past waitress's high watermark, for its client."""
    waitress = server._server
    mark = waitress.adj.outbuf_high_watermark
    return sum(
        1
        for ch in list(waitress.active_channels.values())
        if ch.requests and ch.total_outbufs_len > mark
    )


@pytest.mark.slow
@pytest.mark.parametrize("trickle", [False, True], ids=["never-read", "read-a-trickle"])
def test_clients_that_do_not_read_a_big_page_do_not_hold_every_thread(
    engine: Engine, trickle: bool
) -> None:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    big = pgq.publish(engine, "t", {"blob": "x" * 500_000})
    server = WebServer(Dashboard(engine, WebOptions()), Guard(None), "127.0.0.1", 0, LIMITS)
    server.start()
    try:
        status, took = healthz(server.url)
        assert status == 200, (status, took)
        with slow_readers(server.url, f"/groups/g/messages/{big}", THREADS, trickle):
            # until every thread's answer is stuck (or 30 s: a fixed server may never be)
            deadline = time.monotonic() + 30
            while stalled_answers(server) < THREADS and time.monotonic() < deadline:
                time.sleep(0.1)
            status, took = healthz(server.url)
            assert status == 200, (
                f"/healthz: {status} after {took:.1f}s;"
                f" {stalled_answers(server)} answers stalled on clients that do not read them"
            )
    finally:
        server.close()
