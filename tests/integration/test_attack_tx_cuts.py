"""Attacks on transactional handlers (decision 0042) at the commit and around the
attempt: the connection cut during the COMMIT (chaos proxy), a handler timed out
while it holds a lock, the breaker through an outage with few attempts.

The effect table has no unique key: a duplicate effect is a second row. At the end
every message's effect row exists exactly once and the group's done count equals
the messages.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
from helpers import (
    FAST,
    TX_OUTAGE,
    commit_waiting,
    commits_wait,
    rows,
    transactional_consumer,
    wait_until,
)
from sqlalchemy import Connection, Engine, text

import pgq

WAIT = 30.0
COMMIT_LOCK = (20_517, 12)


@pytest.fixture
def effects(orders: Engine, schema: str) -> str:
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


@pytest.fixture
def holder(pg_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def proxy(pg_dsn: str):
    from chaos.proxy import Proxy

    with Proxy.for_dsn(pg_dsn) as p:
        yield p


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_commit_whose_answer_was_lost_counts_as_done(
    pg_dsn, schema, orders, effects, holder, proxy, batch
):
    """The COMMIT reaches the server and commits; the connection is cut before its
    answer arrives: the row tells the worker it happened, so it counts done (not
    refused), and the effect is there once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3 if batch else 1)])
    commits_wait(orders, schema, COMMIT_LOCK)
    holder.execute("SELECT pg_advisory_lock(%s, %s)", COMMIT_LOCK)
    through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)

    consumer = transactional_consumer(through, handler, batch=batch, workers=1, lease=3.0, **FAST)
    consumer.start()
    try:
        wait_until(lambda: commit_waiting(holder, COMMIT_LOCK), WAIT, "the commit to wait")
        proxy.stall()  # the commit's answer stays in the proxy
        holder.execute("SELECT pg_advisory_unlock(%s, %s)", COMMIT_LOCK)
        wait_until(lambda: done_count(orders) >= 1, WAIT, "the commit")
        proxy.cut()
        proxy.resume()
        wait_until(lambda: consumer.snapshot().handled == len(ids), WAIT, "the attempts counted")
    finally:
        proxy.resume()
        summary = consumer.stop(timeout=10)
        through.dispose()
    assert (summary.done, summary.refused) == (len(ids), 0), summary
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == len(ids)


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_commit_cut_while_the_server_still_runs_it_counts_as_done(
    pg_dsn, schema, orders, effects, holder, proxy, batch
):
    """The connection is cut while the server still works on the COMMIT (a deferred
    trigger, a synchronous replica, a lock): the worker asks the row at once, sees it
    still leased (the COMMIT has not finished) and counts the attempt refused ("lease
    lost"), though the COMMIT goes on to commit effect and ack. `settled` read the row
    without waiting for the transaction that holds it. Now the worker ends the server
    process the commit went to and waits for it to be gone before it reads the row:
    the commit then either happened (counted done) or was ended (counted refused,
    and the message runs again) — never counted refused while it commits."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3 if batch else 1)])
    commits_wait(orders, schema, COMMIT_LOCK)
    holder.execute("SELECT pg_advisory_lock(%s, %s)", COMMIT_LOCK)
    through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)

    consumer = transactional_consumer(through, handler, batch=batch, workers=1, lease=3.0, **FAST)
    consumer.start()
    try:
        wait_until(lambda: commit_waiting(holder, COMMIT_LOCK), WAIT, "the commit to wait")
        proxy.cut()  # the server keeps running the COMMIT
        wait_until(lambda: consumer.snapshot().handled >= 1, 5, "the attempt counted")
        holder.execute("SELECT pg_advisory_unlock(%s, %s)", COMMIT_LOCK)
        wait_until(lambda: done_count(orders) == len(ids), WAIT, "the commit")
    finally:
        holder.execute("SELECT pg_advisory_unlock_all()")
        summary = consumer.stop(timeout=10)
        through.dispose()
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == len(ids)
    assert summary.done == len(ids), summary
    assert summary.refused == summary.handled - len(ids), summary  # ended: it ran again


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_commit_that_never_reached_the_server_runs_again(
    pg_dsn, schema, orders, effects, proxy, batch
):
    """The connection is cut before the outcome and the COMMIT reach the server: nothing
    committed; the message runs again and its effect is there once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3 if batch else 1)])
    through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
    returning, stalled = threading.Event(), threading.Event()

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if message.attempt == 1 and not stalled.is_set():
            returning.set()
            assert stalled.wait(WAIT)

    consumer = transactional_consumer(through, handler, batch=batch, workers=1, lease=2.0, **FAST)
    consumer.start()
    try:
        wait_until(returning.is_set, WAIT, "the handler to be about to return")
        proxy.stall()  # the outcome's UPDATE and the COMMIT stay in the proxy
        stalled.set()
        wait_until(lambda: proxy.open_connections >= 1, WAIT, "connections")
        proxy.cut()  # they never reach the server
        proxy.resume()
        wait_until(lambda: done_count(orders) == len(ids), WAIT, "the message to run again")
    finally:
        stalled.set()
        summary = consumer.stop(timeout=10)
        through.dispose()
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == len(ids)
    assert summary.done == len(ids), summary


def test_a_timed_out_attempt_does_not_keep_its_locks_from_the_retry(orders, effects):
    """The handler takes a lock in pgq's transaction and hangs (an external call);
    the watchdog abandons it at `handler_timeout`, but its transaction stays open
    with the lock until the hung handler returns: every retry blocks behind it, times
    out and is charged, and the message goes dead for nothing. The abandoned attempt's
    transaction must end with it (its writes and locks gone)."""
    mid = pgq.publish(orders, "orders", {"n": 1})
    release = threading.Event()

    def handler(message: pgq.Message, conn: Connection) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(8, :id)"), {"id": message.id})
        write_effect(effects, message, conn)
        if message.attempt == 1:
            release.wait(60)  # hangs past handler_timeout

    consumer = pgq.Consumer(
        orders,
        "billing",
        handler,
        transactional=True,
        handler_timeout=1.0,
        max_attempts=3,
        **FAST,
    )
    consumer.start()
    try:
        wait_until(
            lambda: done_count(orders) == 1 or rows(orders, "billing")[mid].state == "dead",
            WAIT,
            "the message to end",
        )
    finally:
        release.set()
        summary = consumer.stop(timeout=10)
    assert done_count(orders) == 1, (summary, rows(orders, "billing")[mid])
    assert effect_counts(orders, effects) == Counter([mid])


def test_an_outage_with_few_attempts_is_refunded_and_each_effect_commits_once(orders, effects):
    """The dependency fails systemically until the breaker opens, then recovers: the
    failures charged during the outage are refunded (max_attempts=2 would kill them
    otherwise), the probe commits its effect with the close, and every message ends
    done with its effect once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(10)])
    down = threading.Event()
    down.set()

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if down.is_set():
            raise ConnectionError("the dependency is down")

    consumer = pgq.Consumer(
        orders,
        "billing",
        handler,
        transactional=True,
        max_attempts=2,
        **TX_OUTAGE,
    )
    consumer.start()
    try:
        wait_until(
            lambda: pgq.status(orders, "billing")["breaker"]["state"] == "OPEN", WAIT, "open"
        )
        down.clear()
        wait_until(
            lambda: (
                pgq.status(orders, "billing")["breaker"]["state"] == "CLOSED"
                and done_count(orders) + pgq.status(orders, "billing")["counts"]["dead"] == len(ids)
            ),
            WAIT,
            "every message to end",
        )
    finally:
        consumer.stop(timeout=10)
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == len(ids)
