"""Attacks on transactional handlers (decision 0042) through the caller's engine: a
pool smaller than `workers`, the caller's database going away while the member's
own connections stay.

The effect table has no unique key: a duplicate effect is a second row. At the end
of each test every message's effect row exists exactly once, the group's done count
equals the messages, and nothing is lost.
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import FAST, wait_until
from sqlalchemy import Connection, Engine, text

import pgq

WAIT = 30.0


@pytest.fixture
def effects(orders: Engine, schema: str) -> str:
    """A table of the handler's effects in the test's schema; its quoted name."""
    table = f'"{schema}".effects'
    with orders.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (message_id bigint, attempt int)"))
    return table


def effect_counts(engine: Engine, table: str) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.execute(text(f"SELECT message_id FROM {table}")))


def write_effect(table: str, message: pgq.Message, conn: Connection) -> None:
    conn.execute(
        text(f"INSERT INTO {table} VALUES (:id, :attempt)"),
        {"id": message.id, "attempt": message.attempt},
    )


def done_count(engine: Engine) -> int:
    return int(pgq.status(engine, "billing")["counts"]["done"])


def test_a_pool_smaller_than_workers_waits_and_loses_nothing(pg_dsn, schema, orders, effects):
    """The caller's engine holds one connection, the member runs four workers: the
    workers wait their turn for it (or the member refuses to start with a clear
    error); no message is charged, dead or lost, and the member keeps running."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(12)])
    small = pgq.connect(pg_dsn, schema=schema, pool_size=1, max_overflow=0, pool_timeout=1)
    try:

        def handler(message: pgq.Message, conn: Connection) -> None:
            write_effect(effects, message, conn)
            conn.execute(text("SELECT pg_sleep(0.3)"))

        consumer = pgq.Consumer(
            small, "billing", handler, workers=4, transactional=True, max_attempts=2, **FAST
        )
        summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=WAIT)
    finally:
        small.dispose()
    assert consumer.clean, summary
    assert (summary.stop_reason, summary.dead) == ("empty", 0), summary
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == len(ids)


def test_the_callers_database_away_for_a_moment_stops_no_member(pg_dsn, schema, orders, effects):
    """The caller's engine cannot connect for a moment (an outage, a failover) while the
    member's own connections carry on: the handler's connection is not had, which is an
    outage like any other (systemic, retried, the breaker sees it), never a crashed
    worker that stops the whole member."""
    from chaos.proxy import Proxy

    with Proxy.for_dsn(pg_dsn) as proxy:
        through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)

        def handler(message: pgq.Message, conn: Connection) -> None:
            write_effect(effects, message, conn)

        consumer = pgq.Consumer(
            through, "billing", handler, workers=2, transactional=True, max_attempts=50, **FAST
        )
        consumer.start()
        try:
            # the member's session, claims and work connections are open (they stay)
            wait_until(lambda: proxy.open_connections >= 3, WAIT, "the member's connections")
            proxy.refuse()  # new connections only: the handler's pool has none yet
            ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(6)])
            wait_until(lambda: proxy.refused >= 1, WAIT, "a handler's connect refused")
            proxy.allow()
            wait_until(
                lambda: (
                    done_count(orders) == len(ids) or consumer._runtime.member.stopping.is_set()
                ),
                WAIT,
                "all done",
            )
        finally:
            summary = consumer.stop(timeout=10)
            through.dispose()
    assert consumer.clean, summary  # before: "thread crashed thread=pgq-worker-1"
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == len(ids)
