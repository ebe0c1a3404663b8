"""Transactional handlers (DESIGN §7, decision 0042): the handler's writes commit
with the message's `done` outcome, fenced by the lease, or not at all.

Every test counts the effects a handler wrote to a table of its own (`effects`, no
unique key: a duplicate effect shows as a second row) against the messages.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from helpers import FAST, TX_OUTAGE, pin_frontier, rows, state_of, wait_until
from sqlalchemy import Connection, Engine, text

import pgq
from pgq.store import conninfo_of, schema_of

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


def test_each_message_commits_its_effect_with_its_ack(orders, effects):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(50)])

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)

    consumer = pgq.Consumer(orders, "billing", handler, workers=4, transactional=True, **FAST)
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    assert (summary.stop_reason, summary.done, summary.refused) == ("empty", 50, 0)
    assert effect_counts(orders, effects) == Counter(ids)
    assert pgq.status(orders, "billing")["counts"]["done"] == 50


def test_a_raise_rolls_the_writes_back_and_the_message_is_retried(orders, effects):
    ids = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if message.id == ids[0] and message.attempt == 1:
            raise ValueError("after writing")

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, **FAST)
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=WAIT)
    assert (summary.done, summary.retried) == (2, 1)
    assert effect_counts(orders, effects) == Counter(ids)  # the failed attempt's is gone
    with orders.connect() as conn:
        attempts = conn.execute(
            text(f"SELECT attempt FROM {effects} WHERE message_id = :id"), {"id": ids[0]}
        )
        assert [r[0] for r in attempts] == [2]


def test_a_lease_lost_before_the_commit_rolls_the_effect_back(orders, schema, effects):
    """Another member's sweep took the row while the handler ran: the outcome is
    refused, the handler's writes vanish with it, and the message runs again."""
    pin_frontier(orders, "orders")
    mid = pgq.publish(orders, "orders", {"n": 1})
    calls: list[int] = []

    def handler(message: pgq.Message, conn: Connection) -> None:
        calls.append(message.id)
        write_effect(effects, message, conn)
        if len(calls) == 1:  # a reclaim charges no attempt: the next run is attempt 1 too
            with orders.begin() as other:  # what an expiry sweep does to the lease
                other.execute(
                    text(
                        f"UPDATE \"{schema}\".delivery SET state = 'ready', lease_owner = NULL,"
                        " lease_expires_at = NULL, reclaims = reclaims + 1 WHERE message_id = :id"
                    ),
                    {"id": mid},
                )

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, **FAST)
    consumer.start()
    try:
        wait_until(
            lambda: state_of(rows(orders, "billing"), mid) == "done", WAIT, "the message done"
        )
    finally:
        summary = consumer.stop(timeout=10)
    assert (summary.done, summary.refused) == (1, 1)
    assert calls == [mid, mid]
    assert effect_counts(orders, effects) == Counter([mid])  # the second run's alone
    assert rows(orders, "billing")[mid].reclaims == 1


@pytest.mark.parametrize("how", ["commit", "rollback", "close"])
def test_a_handler_that_ends_pgqs_transaction_fails_and_leaves_nothing(orders, effects, how):
    mid = pgq.publish(orders, "orders", {"n": 1})

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        try:
            getattr(conn, how)()
        except pgq.PgqError:
            pass  # a handler that swallows the refusal gains nothing
        if how != "close":
            write_effect(effects, message, conn)

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, max_attempts=1, **FAST)
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    assert (summary.done, summary.dead) == (0, 1)
    assert effect_counts(orders, effects) == Counter()
    row = rows(orders, "billing")[mid]
    assert row.state == "dead"
    assert "transactional handler must not" in row.last_error, row.last_error


def test_a_savepoint_in_the_handler_is_its_own(orders, effects):
    ids = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        savepoint = conn.begin_nested()
        write_effect(effects, message, conn)
        savepoint.rollback()  # only the second write goes

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, **FAST)
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    assert summary.done == 2
    assert effect_counts(orders, effects) == Counter(ids)


def test_a_probe_commits_its_effect_with_the_close(orders, effects):
    """Through an outage: failed attempts leave no effect; the probe that succeeds
    commits its effect, its ack and the group's close together; every message's
    effect is there once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(12)])
    down = threading.Event()
    down.set()
    seen = threading.Event()

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if down.is_set():
            seen.set()
            raise ConnectionError("the dependency is down")

    consumer = pgq.Consumer(
        orders,
        "billing",
        handler,
        transactional=True,
        max_attempts=50,
        **TX_OUTAGE,
    )
    consumer.start()
    try:
        wait_until(
            lambda: pgq.status(orders, "billing")["breaker"]["state"] == "OPEN", WAIT, "open"
        )
        down.clear()
        wait_until(
            lambda: pgq.status(orders, "billing")["counts"]["done"] == len(ids), WAIT, "all done"
        )
    finally:
        consumer.stop(timeout=10)
    assert seen.is_set()
    assert effect_counts(orders, effects) == Counter(ids)
    status = pgq.status(orders, "billing")
    assert status["breaker"]["state"] == "CLOSED"


def test_a_handler_past_its_timeout_commits_nothing(orders, effects):
    """The watchdog abandons an attempt at `handler_timeout` and the message runs
    again; when the abandoned handler returns at last, its writes roll back."""
    mid = pgq.publish(orders, "orders", {"n": 1})
    calls: list[int] = []
    release = threading.Event()

    def handler(message: pgq.Message, conn: Connection) -> None:
        calls.append(message.attempt)
        write_effect(effects, message, conn)
        if len(calls) == 1:
            assert release.wait(WAIT)  # abandoned meanwhile

    consumer = pgq.Consumer(
        orders, "billing", handler, transactional=True, handler_timeout=1.0, **FAST
    )
    consumer.start()
    try:
        wait_until(lambda: state_of(rows(orders, "billing"), mid) == "done", WAIT, "the retry")
        release.set()
        # the abandoned attempt gives its connection back once it has rolled back
        wait_until(lambda: orders.pool.checkedout() == 0, WAIT, "the abandoned attempt's end")
    finally:
        release.set()
        summary = consumer.stop(timeout=10)
    assert calls == [1, 2]
    assert effect_counts(orders, effects) == Counter([mid])
    assert (summary.done, summary.retried) == (1, 1)


def test_a_pool_smaller_than_the_workers_fails_attempts_it_cannot_serve_and_retries(
    orders, effects
):
    """A handler's connection that the caller's pool cannot give in time: the
    attempt never started, so the row goes back uncharged (no failure, nothing for
    the breaker), is claimed again, and every effect is there once."""
    small = pgq.connect(
        conninfo_of(orders), schema=schema_of(orders), pool_size=1, max_overflow=0, pool_timeout=0.2
    )
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(6)])

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        time.sleep(0.3)  # holds the pool's one connection past the others' wait

    consumer = pgq.Consumer(
        small, "billing", handler, transactional=True, workers=3, max_attempts=100, **FAST
    )
    try:
        summary = consumer.run(until_empty=True, wait_retries=10.0, max_runtime=WAIT)
    finally:
        small.dispose()
    assert consumer.clean
    assert (summary.stop_reason, summary.done, summary.retried) == ("empty", 6, 0)
    assert summary.released > 0
    assert effect_counts(orders, effects) == Counter(ids)


def test_a_batch_handler_commits_a_batch_of_effects_with_their_acks(orders, effects):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(60)])
    sizes: list[int] = []

    def batch(messages: list[pgq.Message], conn: Connection) -> None:
        sizes.append(len(messages))
        for message in messages:
            write_effect(effects, message, conn)

    consumer = pgq.Consumer(
        orders, "billing", batch_handler=batch, transactional=True, batch_size=10, **FAST
    )
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    assert (summary.stop_reason, summary.done, summary.refused) == ("empty", 60, 0)
    assert effect_counts(orders, effects) == Counter(ids)
    assert max(sizes) > 1 and max(sizes) <= 10, sizes
    assert pgq.status(orders, "billing")["counts"]["done"] == 60


def test_a_partial_failure_fails_the_named_and_runs_the_others_again_uncharged(orders, effects):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(6)])
    bad = ids[2]
    seen: list[tuple[int, int]] = []

    def batch(messages: list[pgq.Message], conn: Connection) -> None:
        seen.extend((m.id, m.attempt) for m in messages)
        for message in messages:
            write_effect(effects, message, conn)
        failing = {m.id: ValueError("bad row") for m in messages if m.id == bad and m.attempt == 1}
        if failing:
            raise pgq.PartialFailure(failing)

    consumer = pgq.Consumer(
        orders, "billing", batch_handler=batch, transactional=True, workers=1, **FAST
    )
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=WAIT)
    assert (summary.done, summary.retried) == (6, 1)
    assert effect_counts(orders, effects) == Counter(ids)  # the rolled-back batch left none
    assert (bad, 2) in seen  # charged: its second attempt
    others = {mid: max(a for m, a in seen if m == mid) for mid in ids if mid != bad}
    assert set(others.values()) == {1}  # the others ran again uncharged


def test_a_batch_handler_that_raises_fails_every_message_of_the_batch(orders, effects):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    calls: list[int] = []

    def batch(messages: list[pgq.Message], conn: Connection) -> None:
        calls.append(len(messages))
        for message in messages:
            write_effect(effects, message, conn)
        if len(calls) == 1:
            raise ValueError("the whole batch")

    consumer = pgq.Consumer(
        orders, "billing", batch_handler=batch, transactional=True, workers=1, **FAST
    )
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=WAIT)
    assert summary.done == 4
    assert summary.retried == calls[0]
    assert effect_counts(orders, effects) == Counter(ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_handler": lambda msgs, conn: None},
        {"handler": lambda msg: None, "batch_handler": lambda msgs, conn: None},
        {},
    ],
)
def test_a_batch_handler_needs_transactional_and_comes_alone(orders, kwargs):
    with pytest.raises(pgq.UsageError):
        pgq.Consumer(orders, "billing", **kwargs)
