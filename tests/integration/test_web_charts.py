"""The dashboard's charts draw the samples the database keeps (decision 0045): a
restarted dashboard draws what was sampled before it started, by members or by
an earlier dashboard, over the span asked for, with the breaker's OPEN spans
shaded."""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("flask")

from helpers import wait_until
from psycopg.conninfo import make_conninfo
from sqlalchemy import Engine, func, insert, select, text
from test_samples import backdate, sample_rows
from test_web import get

import pgq
from pgq import schema as t
from pgq.store.topics import group_info
from pgq.web import WebOptions, WebServer, dashboard_server
from pgq.web.views import Dashboard


@pytest.fixture
def serve(engine: Engine) -> Iterator[Callable[..., WebServer]]:
    servers: list[WebServer] = []

    def start(on: Engine | None = None, **options: object) -> WebServer:
        server = dashboard_server(
            on or engine, host="127.0.0.1", port=0, options=WebOptions(**options)
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def points_of(body: str) -> dict[str, int]:
    """Each chart's label and how many samples it draws."""
    found = re.findall(r'<svg class="chart"[^>]*aria-label="([^"]*)" data-points="(\d+)"', body)
    return {label: int(n) for label, n in found}


def test_a_restarted_dashboard_draws_what_was_sampled_before_it(orders: Engine, serve):
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    backdate(orders, dt.timedelta(minutes=2), lag=1)  # as a member wrote it then
    first = serve(sample_every=0.1)
    wait_until(lambda: len(sample_rows(orders)) == 2, 10, "the dashboard's own sample")
    first.close()
    second = serve(sample_every=3600)
    page = get(second, "/groups/billing")
    assert page.status == 200, page.body[:2000]
    assert points_of(page.body) == {
        "throughput of billing": 1,
        "lag of billing": 2,
        "oldest ready age of billing": 2,
        "dead rows of billing": 2,
    }
    assert 'id="no-samples"' not in page.body
    overview = get(second, "/")
    assert overview.status == 200
    lag_spark = re.search(
        r'aria-label="lag of billing"><title>[^<]*</title>(.*?)</svg>', overview.body
    )
    assert lag_spark is not None and "<polyline" in lag_spark.group(1)


def test_the_span_chooses_the_samples_and_an_unknown_one_is_refused(orders: Engine, serve):
    backdate(orders, dt.timedelta(hours=3), lag=9)
    server = serve(sample_every=3600)  # its first beat writes this minute's sample
    wait_until(lambda: len(sample_rows(orders)) == 2, 10, "the dashboard's own sample")
    assert points_of(get(server, "/groups/billing?span=1h").body)["lag of billing"] == 1
    assert points_of(get(server, "/groups/billing?span=24h").body)["lag of billing"] == 2
    bad = get(server, "/groups/billing?span=7d")
    assert bad.status == 400 and "unknown span" in bad.body


def test_the_breakers_open_span_is_shaded_on_every_chart(orders: Engine, serve):
    backdate(orders, dt.timedelta(minutes=20), lag=3)
    backdate(orders, dt.timedelta(minutes=2), lag=5)
    gid = group_info(orders, "billing").id
    h = t.breaker_history
    with orders.begin() as conn:
        now = conn.scalar(select(func.now()))
        for epoch, state, ago in ((1, "OPEN", 15), (2, "CLOSED", 5)):
            at = now - dt.timedelta(minutes=ago)
            conn.execute(insert(h).values(group_id=gid, epoch=epoch, state=state, at=at))
        conn.execute(t.breaker.update().where(t.breaker.c.group_id == gid).values(epoch=2))
    body = get(serve(sample_every=3600), "/groups/billing").body
    charts = re.findall(r'<svg class="chart".*?</svg>', body)
    assert len(charts) == 4
    for svg in charts:
        assert len(re.findall(r'<rect class="shade open"', svg)) == 1, svg


def test_a_dashboard_whose_role_may_not_write_samples_says_so_once_and_draws(
    orders: Engine, serve, pg_dsn: str, schema: str, caplog
):
    role = f"charts_ro_{schema}"[:60]
    with orders.begin() as conn:
        conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(text(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"'))
        conn.execute(text(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"'))
    reader = pgq.connect(make_conninfo(pg_dsn, user=role), schema=schema)
    try:
        backdate(orders, dt.timedelta(minutes=2), lag=1)
        with caplog.at_level(logging.WARNING, logger="pgq.web"):
            server = serve(reader, sample_every=0.05)
            wait_until(
                lambda: any("web samples not written" in r.message for r in caplog.records),
                10,
                "the refusal's log line",
            )
            page = get(server, "/groups/billing")
        assert page.status == 200
        assert points_of(page.body)["lag of billing"] == 1
        said = [r for r in caplog.records if "web samples not written" in r.message]
        assert len(said) == 1
        assert len(sample_rows(orders)) == 1  # nothing written
    finally:
        reader.dispose()
        with orders.begin() as conn:
            conn.execute(text(f'DROP OWNED BY "{role}"'))
            conn.execute(text(f'DROP ROLE "{role}"'))


def test_the_overview_reads_the_samples_again_only_after_a_sampler_beat(orders: Engine):
    """The overview updates every 2 s; the samples change once a minute: 500 groups'
    hour (30,000 rows) was read on every update."""
    now = [0.0]
    dashboard = Dashboard(orders, WebOptions(sample_every=20.0), clock=lambda: now[0])
    try:

        def lag_points() -> int:
            [row] = dashboard.overview()["groups"]
            return len(row["lag_points"])

        assert lag_points() == 0
        backdate(orders, dt.timedelta(minutes=2), lag=1)
        now[0] = 19.0
        assert lag_points() == 0  # the read of 0 s ago still stands
        now[0] = 20.0
        assert lag_points() == 1
    finally:
        dashboard.close()
