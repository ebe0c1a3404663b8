"""Topics, groups and publishing against a real server."""

from __future__ import annotations

import threading

import pytest
from helpers import across_groups
from sqlalchemy import Engine, func, select

import pgq
from pgq import schema as t
from pgq.errors import InvalidName, InvalidPayload, UnknownTopic, UsageError
from pgq.store import group_info


def ready_rows(engine: Engine, group: str) -> int:
    d, gid = t.delivery, group_info(engine, group).id
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).where(d.c.group_id == gid, d.c.state == "ready"))


def message_count(engine: Engine) -> int:
    with across_groups(engine) as conn:  # every topic's
        return conn.scalar(select(func.count()).select_from(t.message))


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    """Topic `orders` (the shared fixture) without groups: these tests subscribe their own."""
    return ()


def test_connection_publish_is_invisible_until_commit_and_gone_on_rollback(orders):
    pgq.subscribe(orders, "billing", "orders")
    with orders.connect() as conn:
        conn.begin()
        pgq.publish(conn, "orders", {"n": 1})
        assert ready_rows(orders, "billing") == 0
        conn.rollback()
    assert ready_rows(orders, "billing") == 0
    assert message_count(orders) == 0

    with orders.connect() as conn:
        conn.begin()
        mid = pgq.publish(conn, "orders", {"n": 2})
        assert ready_rows(orders, "billing") == 0
        conn.commit()
    assert ready_rows(orders, "billing") == 1
    with across_groups(orders) as conn:  # by id alone: every topic's shard
        row = conn.execute(select(t.message).where(t.message.c.id == mid)).one()
    assert row.payload == {"n": 2}


def test_publish_many_backfills_earliest_but_not_latest(orders):
    pgq.subscribe(orders, "before", "orders")
    ids = pgq.publish_many(orders, "orders", [{"i": i} for i in range(10_000)])
    assert len(ids) == 10_000 and ids == sorted(ids)
    pgq.subscribe(orders, "early", "orders", start="earliest")
    pgq.subscribe(orders, "late", "orders", start="latest")
    assert ready_rows(orders, "before") == 10_000
    assert ready_rows(orders, "early") == 10_000
    assert ready_rows(orders, "late") == 0
    pgq.subscribe(orders, "early", "orders")  # idempotent: no second backfill
    assert ready_rows(orders, "early") == 10_000
    pgq.publish(orders, "orders", {"i": -1})
    assert ready_rows(orders, "late") == 1


def test_publish_keeps_input_order_key_headers_and_delay(orders):
    pgq.subscribe(orders, "billing", "orders")
    ids = pgq.publish_many(orders, "orders", ["a", "b", "c"], key="k1", headers={"h": "v"})
    with across_groups(orders) as conn:  # every topic's
        rows = conn.execute(select(t.message).order_by(t.message.c.id)).all()
    assert [r.id for r in rows] == ids
    assert [r.payload for r in rows] == ["a", "b", "c"]
    assert {(r.key, r.headers["h"]) for r in rows} == {("k1", "v")}
    pgq.publish(orders, "orders", {"later": True}, delay=3600)
    with across_groups(orders) as conn:  # every group's
        gap = conn.scalar(select(func.max(t.delivery.c.available_at) - func.now()))
    assert gap.total_seconds() > 3500


def test_subscribe_waits_for_open_publish_transaction(orders):
    """A subscribe racing an open publish still gets that message's row."""
    with orders.connect() as conn:
        conn.begin()
        pgq.publish(conn, "orders", {"n": 1})
        done = threading.Event()

        def subscribe_late() -> None:
            pgq.subscribe(orders, "late", "orders", start="latest")
            done.set()

        thread = threading.Thread(target=subscribe_late)
        thread.start()
        assert not done.wait(0.5), "subscribe did not wait for the open publish"
        conn.commit()
    thread.join(10)
    assert done.is_set()
    # the subscriber came after the publish committed: the message was not its
    assert ready_rows(orders, "late") == 0
    pgq.publish(orders, "orders", {"n": 2})
    assert ready_rows(orders, "late") == 1


def test_bad_input_is_rejected_and_writes_nothing(orders):
    with pytest.raises(UnknownTopic, match="nope"):
        pgq.publish(orders, "nope", {"n": 1})
    with pytest.raises(InvalidName):
        pgq.create_topic(orders, "bad name")
    with pytest.raises(InvalidName):
        pgq.create_topic(orders, "x" * 64)
    with pytest.raises(InvalidPayload):
        pgq.publish_many(orders, "orders", [{"ok": 1}, {"bad": object()}])
    with pytest.raises(InvalidPayload):
        pgq.publish(orders, "orders", float("nan"))
    with pytest.raises(UnknownTopic):
        pgq.subscribe(orders, "g", "nope")
    pgq.create_topic(orders, "other")
    pgq.subscribe(orders, "g", "orders")
    with pytest.raises(UsageError, match="already exists on topic"):
        pgq.subscribe(orders, "g", "other")
    assert message_count(orders) == 0


def test_migrate_is_idempotent(engine):
    assert pgq.migrate(engine) == pgq.migrate(engine)
