"""Idle and slow clients cannot starve `pgq web` (issue 21).

Failed before `pgq.web.server.Limits`: waitress stops accepting at its default
100 connections and closes an idle one only after 120 s, so 99 sockets that
send nothing (or a header a byte at a time) locked everyone out, `/healthz`
included. Real sockets against a real server over real PostgreSQL; every wait
is bounded.
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
from helpers import wait_until
from sqlalchemy import Engine

import pgq

pytest.importorskip("flask")

from pgq.web import Dashboard, Guard, WebOptions, WebServer
from pgq.web.server import Limits
from pgq.web.views import READERS

ANSWER_WITHIN = 10.0
"""Seconds `/healthz` and `/` get to answer while the sockets are open."""


def answer_time(url: str, path: str) -> tuple[int, float]:
    """The status of GET `path` and how long it took (`http.client` raises after
    `ANSWER_WITHIN`)."""
    parts = urllib.parse.urlsplit(url)
    began = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=ANSWER_WITHIN)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - began
    finally:
        conn.close()


@contextlib.contextmanager
def attackers(url: str, idle: int, trickling: int) -> Iterator[dict[str, float]]:
    """`idle` sockets that send nothing and `trickling` ones that send a request line,
    then a header a byte every 0.2 s (slow loris), all connected before the body
    runs. Yields {trickler index: seconds until the server closed it}."""
    parts = urllib.parse.urlsplit(url)
    address = (parts.hostname, parts.port)
    stop = threading.Event()
    closed: dict[str, float] = {}
    socks = [socket.create_connection(address, timeout=5) for _ in range(idle)]

    def trickle(k: int) -> None:
        began = time.monotonic()
        with socket.create_connection(address, timeout=5) as s:
            try:
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                while not stop.wait(0.2):
                    s.sendall(b"X")
                    s.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        if s.recv(1) == b"":
                            break
                    s.setblocking(True)
            except OSError:  # reset by the server
                pass
            if not stop.is_set():
                closed[str(k)] = time.monotonic() - began

    threads = [threading.Thread(target=trickle, args=(k,)) for k in range(trickling)]
    for th in threads:
        th.start()
    try:
        yield closed
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        for s in socks:
            s.close()


def dashboard(engine: Engine, limits: Limits) -> WebServer:
    server = WebServer(Dashboard(engine, WebOptions()), Guard(None), "127.0.0.1", 0, limits)
    server.start()
    return server


def pooled(server: WebServer) -> int:
    """Connections the dashboard's reads hold open."""
    pool = server.dashboard._reads.engine.pool
    return pool.checkedin() + pool.checkedout()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_more_than_a_hundred_idle_and_trickling_sockets_leave_it_answering(engine):
    """The report: 150 idle sockets and 20 slow-loris ones (more than waitress's
    default 100 connections) at the default limits."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    server = dashboard(engine, Limits())
    try:
        with attackers(server.url, idle=150, trickling=20):
            for path in ("/healthz", "/", "/healthz"):
                status, took = answer_time(server.url, path)
                assert status == 200 and took < ANSWER_WITHIN, (path, status, took)
            assert pooled(server) <= READERS
    finally:
        server.close()


@pytest.mark.slow
def test_past_the_connection_limit_idle_and_slow_clients_are_dropped_first(engine):
    """More sockets than the limit: the crowded server drops the idle ones after
    `crowded_idle` and the slow loris after `crowded_request`, and answers."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    limits = Limits(connections=40)
    server = dashboard(engine, limits)
    try:
        with attackers(server.url, idle=80, trickling=10) as closed:
            for path in ("/healthz", "/"):
                status, took = answer_time(server.url, path)
                assert status == 200 and took < ANSWER_WITHIN, (path, status, took)
            wait_until(lambda: len(closed) == 10, 30, "every slow loris dropped", interval=0.2)
            assert pooled(server) <= READERS
    finally:
        server.close()


@pytest.mark.slow
def test_a_request_trickled_in_is_dropped_after_its_deadline(engine):
    """Uncrowded, a request whose bytes keep coming slower than `request` seconds is
    dropped then (each byte reset waitress's idle timer: no limit at all before)."""
    limits = Limits(request=2.0)
    server = dashboard(engine, limits)
    try:
        with attackers(server.url, idle=0, trickling=3) as closed:
            wait_until(lambda: len(closed) == 3, 15, "the slow lorises dropped", interval=0.2)
        assert all(limits.request <= took < limits.request + 4 for took in closed.values()), closed
    finally:
        server.close()
