"""A group's whole life (issue 21, "day two").

`pgq topics` lists every topic; `pgq topic delete` and `pgq unsubscribe` remove a
topic or a group, audited, so that an abandoned or mistyped group no longer holds
back retention; the trail of a removed group stays readable. A member that starts
during an unsubscribe fails cleanly; a live one makes it refuse unless forced.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from helpers import (
    FAST,
    across_groups,
    assert_usage_error,
    expire_all,
    invoke,
    wait_for_frontier,
    wait_until,
    waiting_on,
)
from sqlalchemy import Engine, func, insert, select, text, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.errors import UnknownGroup, UnknownTopic, UsageError
from pgq.sql import lifecycle as lifecycle_sql
from pgq.sql.locks import topic_key, topic_lock
from pgq.sql.publish import lock_topic_for_publish
from pgq.store import placement
from pgq.store.lifecycle import lock_topic

GROUP, ABANDONED = "billing", "abandoned"


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    return (GROUP, ABANDONED)


def ok(result: Any) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return str(result.stdout)


def count(engine: Engine, table: Any, **where: Any) -> int:
    with across_groups(engine) as conn:  # a test's count, over every group unless told
        stmt = select(func.count()).select_from(table)
        for column, value in where.items():
            stmt = stmt.where(table.c[column] == value)
        return int(conn.execute(stmt).scalar_one())


def gid_of(engine: Engine, group: str) -> int:
    with engine.connect() as conn:
        g = t.consumer_group
        return int(conn.execute(select(g.c.id).where(g.c.name == group)).scalar_one())


# --- pgq topics ----------------------------------------------------------------------


def test_topics_lists_every_topic_its_messages_and_groups(orders, pgq_env):
    pgq.create_topic(orders, "spare")
    pgq.publish_many(orders, "orders", [1, 2, 3])
    listed = pgq.topics(orders).to_json()
    assert listed["topics"] == [
        {
            "topic": "orders",
            "messages": 3,
            "groups": [{"group": ABANDONED}, {"group": GROUP}],
            "created_at": listed["topics"][0]["created_at"],
        },
        {
            "topic": "spare",
            "messages": 0,
            "groups": [],
            "created_at": listed["topics"][1]["created_at"],
        },
    ]
    assert all(tp["created_at"].endswith("+00:00") for tp in listed["topics"])
    assert json.loads(ok(invoke(pgq_env, "topics", "--json"))) == listed
    lines = ok(invoke(pgq_env, "topics")).splitlines()
    assert [line.split() for line in lines] == [
        ["TOPIC", "MESSAGES", "GROUPS"],
        ["orders", "3", f"{ABANDONED},{GROUP}"],
        ["spare", "0", "-"],
    ]


def test_topics_of_an_empty_schema(engine, pgq_env):
    assert ok(invoke(pgq_env, "topics")) == "no topics\n"
    assert json.loads(ok(invoke(pgq_env, "topics", "--json"))) == {"topics": []}


# --- pgq unsubscribe -----------------------------------------------------------------


def test_unsubscribe_removes_the_group_and_retention_is_no_longer_held_back(orders, pgq_env):
    """The reported defect: a group nobody consumes holds every message for ever."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(6)])
    summary = pgq.Consumer(orders, GROUP, lambda m: None, **FAST).run(until_empty=True)
    assert summary.done == 6
    # the finished group's last row goes once its frontier passes it, which another
    # session's transaction on a shared server can hold up past the run's last pass
    wait_for_frontier(orders, GROUP, ids[-1], advance=True)
    gid = gid_of(orders, ABANDONED)
    d = t.delivery
    with orders.begin() as conn:  # what a group that ran once leaves besides its rows
        dead = d.c.group_id == gid, d.c.message_id.in_(ids[:2])
        conn.execute(update(d).where(*dead).values(state="dead", error_class="message"))
        conn.execute(insert(t.member).values(group_id=gid, name="old", host="h", pid=1))
        conn.execute(insert(t.breaker_history).values(group_id=gid, epoch=1, state="OPEN"))
        conn.execute(insert(t.probe).values(group_id=gid, epoch=1, outcome="failed"))
    # the finished group's rows are pruned behind its frontier; the abandoned one's stay
    wait_until(lambda: expire_all(orders) == 0 and count(orders, t.delivery, group_id=gid) == 6, 10)
    assert count(orders, t.message) == 6, "the abandoned group holds every message back"

    out = ok(invoke(pgq_env, "unsubscribe", ABANDONED, "--reason", "mistyped name"))
    assert out == f"removed group {ABANDONED} (6 rows)\n"
    for table in (t.delivery, t.member, t.breaker_history, t.probe, t.breaker, t.group_state):
        assert count(orders, table, group_id=gid) == 0, table.name
    assert count(orders, t.consumer_group, id=gid) == 0
    assert expire_all(orders) == 6  # retention deletes them now
    assert count(orders, t.message) == 0
    # its trail outlives it: the unsubscribe itself is on it
    [row] = monitor.audit(orders, ABANDONED)
    assert (row["action"], row["count"], row["message_ids"]) == ("unsubscribe", 6, ids)
    assert (row["group"], row["topic"], row["reason"]) == (ABANDONED, "orders", "mistyped name")
    assert json.loads(ok(invoke(pgq_env, "audit", ABANDONED, "--json"))) == [row]
    # the other group is untouched, and the removed one is gone for every command
    assert pgq.status(orders, GROUP)["counts"]["done"] == 6
    with pytest.raises(UnknownGroup):
        pgq.status(orders, ABANDONED)
    result = invoke(pgq_env, "unsubscribe", ABANDONED, "--reason", "again")
    assert_usage_error(result.exit_code, result.stderr, contains=f"unknown group '{ABANDONED}'")
    assert [tp["groups"] for tp in pgq.topics(orders).to_json()["topics"]] == [[{"group": GROUP}]]


def test_a_group_subscribed_again_under_the_name_starts_afresh(orders):
    pgq.publish_many(orders, "orders", [1, 2])
    pgq.unsubscribe(orders, ABANDONED, reason="reset")
    pgq.subscribe(orders, ABANDONED, "orders", start="latest")
    status = pgq.status(orders, ABANDONED)
    assert status["counts"]["ready"] == 0 and status["breaker"]["state"] == "CLOSED"
    assert [a["action"] for a in monitor.audit(orders, ABANDONED)] == []  # a new group's trail


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        ((ABANDONED,), "--reason is required"),
        ((ABANDONED, "--reason", "  "), "--reason is required"),
        ((ABANDONED, "--reason", "a\x00b"), "NUL"),
        (("nosuch", "--reason", "x"), "unknown group 'nosuch'"),
        (("bad name", "--reason", "x"), "invalid group name"),
    ],
)
def test_bad_unsubscribe_is_one_line_exit_2_and_removes_nothing(orders, pgq_env, args, contains):
    result = invoke(pgq_env, "unsubscribe", *args)
    assert_usage_error(result.exit_code, result.stderr, contains=contains)
    assert count(orders, t.consumer_group) == 2 and count(orders, t.audit) == 0


def test_unsubscribe_is_refused_while_a_member_is_live_unless_forced(orders, pgq_env):
    pgq.publish_many(orders, "orders", [1])
    release = threading.Event()

    def handler(msg: pgq.Message) -> None:
        release.wait(30)

    member = pgq.Consumer(orders, ABANDONED, handler, name="live-one", **FAST)
    runner = threading.Thread(target=member.run, name="test-member")
    runner.start()
    try:
        wait_until(lambda: monitor.members(orders, ABANDONED), 10, "the member to join")
        result = invoke(pgq_env, "unsubscribe", ABANDONED, "--reason", "x")
        # (the member runs in this process: its log lines may land in stderr too)
        assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
        assert (
            f"pgq: error: group '{ABANDONED}' has 1 live member(s): 'live-one';"
            " stop them first, or unsubscribe with --force\n"
        ) in result.stderr
        assert count(orders, t.consumer_group) == 2 and count(orders, t.audit) == 0
        out = ok(invoke(pgq_env, "unsubscribe", ABANDONED, "--reason", "x", "--force"))
        assert out == f"removed group {ABANDONED} (1 rows, 1 live member(s) removed)\n"
        # the member finds its row gone at its next heartbeat and stops
        release.set()
        runner.join(15)
        assert not runner.is_alive()
    finally:
        release.set()
        member.request_stop()
        runner.join(15)
    assert count(orders, t.member) == 0 and count(orders, t.consumer_group, name=ABANDONED) == 0


def test_a_member_that_starts_during_an_unsubscribe_fails_cleanly(orders, schema):
    """The unsubscribe waits on a publisher's topic lock (it holds the group lock by
    then); a member starting meanwhile waits for it, then finds the group gone."""
    results: dict[str, Any] = {}

    def unsubscribe() -> None:
        results["unsubscribed"] = pgq.unsubscribe(orders, ABANDONED, reason="race")

    def start() -> None:
        try:
            pgq.Consumer(orders, ABANDONED, lambda m: None, **FAST).run(until_empty=True)
        except Exception as exc:
            results["member"] = exc

    with orders.connect() as publisher, publisher.begin():
        # a publish in flight: the topic lock held shared, as a publish holds it
        if placement.distributed(publisher):
            publisher.execute(topic_lock(shared=True), {"key": topic_key(schema, "orders")})
        else:
            publisher.execute(lock_topic_for_publish(), {"topic": "orders"})
        pid = publisher.execute(text("SELECT pg_backend_pid()")).scalar_one()
        remover = threading.Thread(target=unsubscribe)
        remover.start()
        wait_until(lambda: waiting_on(orders, pid), 10, "the unsubscribe")
        joiner = threading.Thread(target=start)
        joiner.start()
        wait_until(
            lambda: waiting_on(orders, pid, "%pg_advisory_xact_lock_shared%"), 10, "the join"
        )
    remover.join(15)
    joiner.join(15)
    assert results["unsubscribed"].forced == ()
    assert isinstance(results["member"], UnknownGroup), results
    assert "was removed" in str(results["member"])
    assert count(orders, t.member) == 0


# --- pgq topic delete ----------------------------------------------------------------


def test_topic_delete_is_refused_while_a_group_is_subscribed_then_audited(orders, pgq_env):
    ids = pgq.publish_many(orders, "orders", [1, 2, 3])
    result = invoke(pgq_env, "topic", "delete", "orders", "--reason", "done with it")
    assert_usage_error(
        result.exit_code, result.stderr, contains=f"2 group(s) subscribed: '{ABANDONED}', '{GROUP}'"
    )
    assert count(orders, t.message) == 3 and count(orders, t.audit) == 0
    for group in (GROUP, ABANDONED):
        pgq.unsubscribe(orders, group, reason="moving off")
    out = ok(invoke(pgq_env, "topic", "delete", "orders", "--reason", "done with it"))
    assert out == "deleted topic orders (3 messages)\n"
    assert count(orders, t.message) == 0 and count(orders, t.topic) == 0
    trail = monitor.audit(orders, None, topic="orders")
    assert [(a["action"], a["group"], a["count"]) for a in trail] == [
        ("delete-topic", None, 3),
        ("unsubscribe", ABANDONED, 3),
        ("unsubscribe", GROUP, 3),
    ]
    assert trail[0]["message_ids"] == ids
    assert json.loads(ok(invoke(pgq_env, "audit", "--topic", "orders", "--json"))) == trail
    with pytest.raises(UnknownTopic):
        pgq.publish(orders, "orders", 1)
    with pytest.raises(UnknownTopic):
        pgq.subscribe(orders, "late", "orders")
    for args, contains in (
        (("nosuch", "--reason", "x"), "unknown topic 'nosuch'"),
        (("orders",), "--reason is required"),
    ):
        result = invoke(pgq_env, "topic", "delete", *args)
        assert_usage_error(result.exit_code, result.stderr, contains=contains)
    result = invoke(pgq_env, "audit", "--topic", "nosuch")
    assert_usage_error(result.exit_code, result.stderr, contains="unknown topic 'nosuch'")
    result = invoke(pgq_env, "audit", GROUP, "--topic", "orders")
    assert_usage_error(result.exit_code, result.stderr, contains="not both")


def test_a_publish_waiting_for_a_topic_delete_finds_no_topic(orders):
    pgq.unsubscribe(orders, GROUP, reason="x")
    pgq.unsubscribe(orders, ABANDONED, reason="x")
    results: dict[str, Any] = {}

    def publish_late() -> None:
        try:
            pgq.publish(orders, "orders", {"late": True})
        except Exception as exc:
            results["late"] = exc

    with orders.connect() as deleter, deleter.begin():
        # the delete's own lock and statement, with a publisher arriving between them
        topic_id = lock_topic(deleter, "orders")
        pid = deleter.execute(text("SELECT pg_backend_pid()")).scalar_one()
        late = threading.Thread(target=publish_late)
        late.start()
        wait_until(lambda: waiting_on(orders, pid), 10, "the publisher to wait")
        deleter.execute(lifecycle_sql.delete_topic(), {"topic_id": topic_id})
    late.join(15)
    assert isinstance(results.get("late"), UnknownTopic), results
    assert count(orders, t.message) == 0


def test_library_checks(orders):
    with pytest.raises(UsageError, match="non-empty reason"):
        pgq.unsubscribe(orders, GROUP, reason=" ")
    with pytest.raises(UsageError, match="non-empty reason"):
        pgq.delete_topic(orders, "orders", reason="")
    with pytest.raises(UsageError, match="invalid topic name"):
        pgq.delete_topic(orders, "a b", reason="x")
    with pytest.raises(UsageError, match="not both"):
        monitor.audit(orders, GROUP, topic="orders")
