"""Attack (issue 21, decision 0031): a member's metrics scrapes and its connections.

DESIGN §7: "a member uses at most 3 PostgreSQL connections, each with an
`application_name` of the form `pgq/<group>/<member>/<role>`". A member started
with `--metrics-port` reads its group's numbers on every scrape through the
engine's own pool (`ConsumerCollector._group_status`, `monitor.check`), not
through one of its three role connections: concurrent scrapes (Prometheus
with two replicas, a human with curl) open more connections, named after
nothing pgq knows (libpq's default `application_name`), and those reads run
without the read deadline the dashboard has: while the route to the database
stops answering (the chaos proxy's `stall`), a scrape hangs for as long as the
stall lasts instead of answering what the member knows from memory (its
counts, breakers, histograms) within Prometheus' default scrape timeout (10 s).
"""

from __future__ import annotations

import signal
import threading
import urllib.request

import pytest
from chaos.proxy import Proxy
from helpers import consumer_env, finish, reap, spawn_pgq, wait_until
from sqlalchemy import Engine, text

pytest.importorskip("prometheus_client")

TAG = "attack-ops-metrics-member"
"""The member's name, and libpq's default `application_name` of its process
(`PGAPPNAME`): a connection the member did not name shows this."""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def connections(engine: Engine) -> list[str]:
    """The `application_name` of every connection of the member's process."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT application_name FROM pg_stat_activity"
                    " WHERE application_name = :tag OR application_name LIKE :named"
                    " ORDER BY 1"
                ),
                {"tag": TAG, "named": f"pgq/billing/{TAG}/%"},
            ).scalars()
        )


def test_scrapes_keep_the_member_within_its_three_named_connections(
    orders: Engine, pgq_env, tmp_path, procs
):
    port = free_port()
    env = consumer_env(
        pgq_env,
        tmp_path,
        PGAPPNAME=TAG,
        PGQ_BREAKER_HEARTBEAT=0.2,
        PGQ_BREAKER_MEMBER_TTL=1.0,
        PGQ_POLL_INTERVAL=0.1,
    )
    proc = spawn_pgq(
        env,
        *("consume", "billing", "--handler", "handlers:record", "--name", TAG),
        *("--metrics-port", str(port)),
    )
    procs.append(proc)
    wait_until(lambda: len(connections(orders)) >= 3, 30, "the member's three connections")

    def scrape() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as resp:
            resp.read()

    wait_until(lambda: _answers(scrape), 30, "the metrics endpoint")
    scrapers = [threading.Thread(target=scrape) for _ in range(4)]
    for s in scrapers:
        s.start()
    for s in scrapers:
        s.join(30)
    seen = connections(orders)

    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    assert code == 0, err
    assert len(seen) <= 3 and all(name.startswith("pgq/") for name in seen), (
        f"the member holds {len(seen)} connections after 4 concurrent scrapes: {seen}"
    )


def _answers(scrape) -> bool:
    try:
        scrape()
    except OSError:
        return False
    return True


SCRAPE_TIMEOUT = 10.0
"""Prometheus' default `scrape_timeout`."""


def test_a_scrape_answers_while_the_database_does_not(orders: Engine, pg_dsn, pgq_env, tmp_path):
    port = free_port()
    with Proxy.for_dsn(pg_dsn) as proxy:
        env = consumer_env(
            {**pgq_env, "PGQ_DSN": proxy.dsn(pg_dsn)},
            tmp_path,
            PGQ_BREAKER_HEARTBEAT=0.2,
            PGQ_BREAKER_MEMBER_TTL=1.0,
            PGQ_POLL_INTERVAL=0.1,
        )
        proc = spawn_pgq(
            env,
            *("consume", "billing", "--handler", "handlers:record"),
            *("--metrics-port", str(port)),
        )
        try:

            def scrape() -> None:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as resp:
                    resp.read()

            wait_until(lambda: _answers(scrape), 30, "the metrics endpoint")
            proxy.stall()  # the database stops answering; nothing is closed
            try:
                try:
                    scrape()
                except OSError as exc:
                    raise AssertionError(
                        f"a scrape got no answer within {SCRAPE_TIMEOUT:g}s"
                        f" while the database did not answer: {exc!r}"
                    ) from None
            finally:
                proxy.resume()
            proc.send_signal(signal.SIGTERM)
            finish(proc, 60)
        finally:
            reap(proc)
