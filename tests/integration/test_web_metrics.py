"""`pgq web`'s `/metrics` (issue 21, DESIGN §7): every group's state read from the
database, in the Prometheus text format, so a group with no member running is
still observable. A real dashboard server on 127.0.0.1 (port 0) over real
PostgreSQL; the answer is parsed with prometheus-client's own parser.
"""

from __future__ import annotations

import datetime as dt
import http.client
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import FAST, kill, set_rows
from sqlalchemy import Engine, select, update

import pgq
from pgq import schema as t
from pgq.web import WebOptions, WebServer, dashboard_server

pytest.importorskip("flask")
parser = pytest.importorskip("prometheus_client.parser")

TOKEN = "web-metrics-a3f7c1e9b5d20864"

GROUP_FAMILIES = {
    "pgq_group_ready_rows",
    "pgq_group_leased_rows",
    "pgq_group_dead_rows",
    "pgq_group_dead_systemic_rows",
    "pgq_group_lag",
    "pgq_group_oldest_ready_age_seconds",
    "pgq_group_done_total",
    "pgq_group_reclaimed_total",
    "pgq_group_released_total",
    "pgq_group_refunded_rows",
    "pgq_group_breaker_epoch",
    "pgq_group_live_members",
    "pgq_group_breaker_state",
}


@pytest.fixture
def serve(engine: Engine) -> Iterator[Callable[..., WebServer]]:
    servers: list[WebServer] = []

    def start(on: Engine | None = None, **kwargs: Any) -> WebServer:
        server = dashboard_server(
            engine if on is None else on, host="127.0.0.1", port=0, options=WebOptions(), **kwargs
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def scrape(server: WebServer, **headers: str) -> tuple[int, str, str]:
    """Status, content type and body of `GET /metrics`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


def samples(body: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in parser.text_string_to_metric_families(body)
        for s in family.samples
    }


def of(found: dict[tuple[str, frozenset[tuple[str, str]]], float], group: str) -> dict[str, float]:
    """The samples of `group` by name (the breaker state's as `..._state:STATE`)."""
    mine: dict[str, float] = {}
    for (name, labels), value in found.items():
        lab = dict(labels)
        if lab.get("group") != group:
            continue
        mine[f"{name}:{lab['state']}" if "state" in lab else name] = value
    return mine


def test_metrics_show_groups_no_member_runs(engine, serve):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.create_topic(engine, "quiet")
    pgq.subscribe(engine, "idle", "quiet")
    pgq.publish_many(engine, "t", [{"n": i} for i in range(4)])
    drained = pgq.Consumer(engine, "g", lambda m: None, workers=1, **FAST).run(until_empty=True)
    assert drained.done == 4
    systemic, message, leased, *_ = pgq.publish_many(engine, "t", [{"n": i} for i in range(5)])
    kill(engine, [systemic], "systemic")
    kill(engine, [message], "message")
    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    set_rows(engine, [leased], state="leased", lease_owner="gone", lease_expires_at=soon)
    with engine.begin() as conn:
        gid = conn.execute(select(t.consumer_group.c.id).where(t.consumer_group.c.name == "g"))
        conn.execute(
            update(t.breaker)
            .where(t.breaker.c.group_id == gid.scalar_one())
            .values(state="OPEN", epoch=3, next_probe_at=soon)
        )

    server = serve(token=TOKEN)  # an admin dashboard: /metrics needs no login all the same
    code, content_type, body = scrape(server)
    assert code == 200, body
    assert content_type.startswith("text/plain") and "version=" in content_type
    found = samples(body)
    names = {name for name, _ in found}
    assert names >= GROUP_FAMILIES, GROUP_FAMILIES - names
    for (_, labels), _ in found.items():  # every sample names its group and topic
        assert {"group", "topic"} <= dict(labels).keys(), labels
    assert ("pgq_group_lag", frozenset({("group", "g"), ("topic", "t")})) in found

    g = of(found, "g")
    assert g["pgq_group_ready_rows"] == 2
    assert g["pgq_group_leased_rows"] == 1
    assert g["pgq_group_dead_rows"] == 2
    assert g["pgq_group_dead_systemic_rows"] == 1
    assert g["pgq_group_lag"] == 3
    assert g["pgq_group_done_total"] == 4
    assert g["pgq_group_reclaimed_total"] == 0
    assert g["pgq_group_released_total"] == 0
    assert g["pgq_group_refunded_rows"] == 0
    assert g["pgq_group_breaker_state:OPEN"] == 1 and g["pgq_group_breaker_state:CLOSED"] == 0
    assert g["pgq_group_breaker_epoch"] == 3
    assert g["pgq_group_live_members"] == 0
    assert 0 <= g["pgq_group_oldest_ready_age_seconds"] < 60  # published just now
    status = pgq.status(engine, "g")  # the same numbers as `pgq status g --json`
    assert g["pgq_group_lag"] == status["lag"]
    assert {k: g[f"pgq_group_{k}_rows"] for k in ("ready", "leased", "dead", "dead_systemic")} == {
        k: status["counts"][k] for k in ("ready", "leased", "dead", "dead_systemic")
    }

    idle = of(found, "idle")
    assert idle["pgq_group_lag"] == 0 and idle["pgq_group_done_total"] == 0
    assert "pgq_group_oldest_ready_age_seconds" not in idle  # no row ready: no sample
    assert idle["pgq_group_breaker_state:CLOSED"] == 1 and idle["pgq_group_breaker_state:OPEN"] == 0
    assert idle["pgq_group_live_members"] == 0


def test_metrics_count_a_live_member_and_follow_the_database(engine, serve):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    server = serve()
    assert of(samples(scrape(server)[2]), "g")["pgq_group_lag"] == 0
    pgq.publish_many(engine, "t", [{"n": i} for i in range(3)])
    assert of(samples(scrape(server)[2]), "g")["pgq_group_lag"] == 3  # no cache between scrapes
    with pgq.Consumer(engine, "g", lambda m: None, workers=1, **FAST):
        assert of(samples(scrape(server)[2]), "g")["pgq_group_live_members"] == 1

    # Prometheus asks for OpenMetrics first: it gets it
    code, content_type, body = scrape(
        server, Accept="application/openmetrics-text; version=1.0.0,text/plain;q=0.5"
    )
    assert code == 200 and content_type.startswith("application/openmetrics-text"), content_type
    assert body.endswith("# EOF\n")
    assert "pgq_group_done_total{" in body and "# TYPE pgq_group_done counter" in body


def test_metrics_without_groups_and_without_a_database(engine, serve):
    pgq.migrate(engine)
    code, _, body = scrape(serve())
    assert code == 200 and not [s for s in samples(body) if s[0].startswith("pgq_")]

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    gone = pgq.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", schema="nowhere")
    try:
        code, _, body = scrape(serve(gone))
        assert code == 503, body  # Prometheus marks the target down (`up` 0)
    finally:
        gone.dispose()
