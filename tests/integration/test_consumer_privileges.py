"""A consumer under a restricted role (issue 11, defect 6).

A role with exactly the privileges a consumer needs (`pgq.sql.privileges`) runs
a whole outage: claims, failures, the quorum opening the group, probes, the
close and its reconciliation, pruning and retention — nothing is refused. A
role missing any one of them is refused at `run()` with `PermissionDenied`
naming what it lacks, before the member joins; one whose privilege is revoked
while it runs stops, and `run()` raises `PermissionDenied` once it is down.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import psycopg
import pytest
from helpers import FAST, LONE_OUTAGE, wait_until
from roles import EVERYTHING, consumer_role
from sqlalchemy import Engine, select, update
from sqlalchemy.exc import DBAPIError

import pgq
from pgq import schema as t
from pgq.errors import PermissionDenied
from pgq.sql import frontier as frontier_sql
from pgq.store import GroupStore, group_info, run_once


class Role(NamedTuple):
    name: str
    engine: Engine


OUTAGE = LONE_OUTAGE


@pytest.fixture
def as_role(pg_dsn: str, schema: str, orders: Engine) -> Iterator[Callable[..., Role]]:
    """`as_role(*without)`: a consumer role missing `without`, and a pgq engine on
    this test's schema that logs in as it (both gone at the end)."""
    with contextlib.ExitStack() as stack:

        def make(*without: tuple[str, str]) -> Role:
            name, dsn = stack.enter_context(consumer_role(pg_dsn, schema, without))
            eng = pgq.connect(dsn, schema=schema)
            stack.callback(eng.dispose)
            return Role(name, eng)

        yield make


def lacking(message: str) -> set[tuple[str, str]]:
    """The (object, privilege) pairs a refusal names: "... needs: SELECT, UPDATE on
    s.message; UPDATE on s.topic.created_at; USAGE on schema s (pgq grant ...)"
    gives ("message", "SELECT"), ..., ("topic.created_at", "UPDATE"), ..."""
    listed = message.split(" needs: ", 1)[1].split(" (pgq grant ", 1)[0]
    found = set()
    for part in listed.split("; "):
        privileges, _, where = part.partition(" on ")
        # "schema s", "s.message", or "s.topic.created_at" for a column
        name = "schema" if where.startswith("schema ") else where.split(".", 1)[1]
        found |= {(name, p) for p in privileges.split(", ")}
    return found


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines of a member's work that the database refused or that crashed a thread."""
    words = ("task refused", "pass refused", "crashed", "permission denied", "task failed", "lacks")
    return [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in words)]


def test_exactly_the_consumer_privileges_run_a_whole_outage(orders, as_role, caplog):
    caplog.set_level(logging.INFO, logger="pgq")
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(12)])
    down = threading.Event()
    down.set()

    def handler(msg: pgq.Message) -> None:
        if down.is_set():
            raise pgq.SystemicError("dependency down")

    eng = as_role().engine
    consumer = pgq.Consumer(eng, "billing", handler, **OUTAGE)
    consumer.start()
    try:
        wait_until(
            lambda: pgq.status(orders, "billing")["breaker"]["state"] == "OPEN",
            20,
            "the quorum to open the group",
        )
        down.clear()
        wait_until(
            lambda: (
                (s := pgq.status(orders, "billing"))["breaker"]["state"] == "CLOSED"
                and s["lag"] == 0
            ),
            30,
            "the prober to close the group and the backlog to drain",
        )
    finally:
        summary = consumer.stop(timeout=10)
    status = pgq.status(orders, "billing")
    assert status["counts"]["done"] == len(ids) and status["counts"]["dead"] == 0
    assert status["breaker"]["epoch"] >= 2  # opened and closed
    assert summary.done >= 1
    assert not refusals(caplog), refusals(caplog)
    # a cron run as the same role: retention and pruning run at its start
    drained = pgq.Consumer(eng, "billing", handler, **OUTAGE).run(until_empty=True)
    assert drained.stop_reason == "empty"
    assert not refusals(caplog), refusals(caplog)


@pytest.mark.parametrize(
    "without",
    [
        (("breaker", "UPDATE"),),
        (("probe", "INSERT"),),
        (("message", "SELECT"),),
        (("message", "DELETE"),),
        (("lease_token", "USAGE"),),
        (("topic.created_at", "UPDATE"),),
        (("message.created_at", "UPDATE"),),
        EVERYTHING,
    ],
    ids=[
        "breaker-update",
        "probe-insert",
        "message-select",
        "message-delete",
        "sequence",
        "topic-lock",
        "message-lock",
        "nothing",
    ],
)
def test_a_missing_privilege_is_refused_before_joining(orders, as_role, schema, without):
    pgq.publish(orders, "orders", {"n": 1})
    eng = as_role(*without).engine
    consumer = pgq.Consumer(eng, "billing", lambda m: None, **FAST)
    with pytest.raises(PermissionDenied) as info:
        consumer.run(until_empty=True)
    message = str(info.value)
    assert "\n" not in message
    assert lacking(message) == set(without), message
    assert pgq.status(orders, "billing")["members"] == []  # it never joined
    assert pgq.status(orders, "billing")["counts"]["ready"] == 1


@pytest.mark.parametrize(
    "without",
    [(), (("topic.created_at", "UPDATE"),), (("message.created_at", "UPDATE"),)],
    ids=["all", "topic-lock", "message-lock"],
)
def test_retention_needs_update_on_one_column_to_lock(orders, as_role, without):
    """Retention locks the topic row (FOR KEY SHARE) and the expired messages (FOR
    UPDATE) and updates neither: UPDATE on `created_at` is what lets it lock, and
    each is needed by the statements themselves, not only by the start-up check."""
    pgq.create_topic(orders, "unread")  # no group: its messages expire at once
    pgq.publish(orders, "unread", {"n": 1})
    with orders.connect() as conn:
        topic_id = conn.execute(select(t.topic.c.id).where(t.topic.c.name == "unread")).scalar()
    eng = as_role(*without).engine

    def expire() -> list[Any]:
        with eng.begin() as conn:
            conn.execute(frontier_sql.lock_topic_for_retention(), {"topic_id": topic_id})
            params = {"topic_id": topic_id, "retention": dt.timedelta(0), "limit": 10}
            return list(conn.execute(frontier_sql.delete_expired_messages(), params).all())

    if not without:
        assert len(expire()) == 1
        return
    with pytest.raises(DBAPIError) as info:
        expire()
    assert isinstance(info.value.orig, psycopg.errors.InsufficientPrivilege), info.value


@pytest.mark.parametrize(
    "without",
    [(), (("probe", "INSERT"),), (("probe", "SELECT"),), (("probe", "DELETE"),)],
    ids=["all", "insert", "select", "delete"],
)
def test_the_probe_log_needs_each_of_its_privileges(orders, as_role, without):
    """A probe's outcome writes its log row (INSERT); retention chooses the old ones
    by their time (SELECT) and deletes them (DELETE): each is needed by the statements
    themselves, not only by the start-up check."""
    with orders.begin() as conn:
        conn.execute(update(t.breaker).values(state="OPEN", epoch=1, next_probe_at=None))
    gid = group_info(orders, "billing").id
    store = GroupStore(gid, "billing", "orders", "prober", 30, 3)
    eng = as_role(*without).engine
    work: dict[str, Callable[[], object]] = {
        "log": lambda: run_once(eng, store.probe_failed, 1, 1.0, 7),
        "prune": lambda: run_once(eng, store.expire_probes, -1.0),
    }
    done: dict[str, object] = {}
    for what, do in work.items():
        try:
            done[what] = do()
        except PermissionDenied:
            done[what] = "refused"
    expected = {
        (): {"log": 1, "prune": 1},
        (("probe", "INSERT"),): {"log": "refused", "prune": 0},
        (("probe", "SELECT"),): {"log": 1, "prune": "refused"},
        (("probe", "DELETE"),): {"log": 1, "prune": "refused"},
    }
    assert done == expected[without]


def test_a_role_granted_by_an_earlier_pgq_still_starts(orders, as_role, schema):
    """Earlier pgq granted UPDATE on the whole of `topic` and `message`; a role that
    has it has UPDATE on their `created_at` too, and more than the list is fine."""
    role, eng = as_role(("topic.created_at", "UPDATE"), ("message.created_at", "UPDATE"))
    with orders.begin() as conn:
        conn.exec_driver_sql(f'GRANT UPDATE ON "{schema}".topic, "{schema}".message TO "{role}"')
    pgq.publish(orders, "orders", {"n": 1})
    summary = pgq.Consumer(eng, "billing", lambda m: None, **FAST).run(until_empty=True)
    assert summary.stop_reason == "empty"
    assert pgq.status(orders, "billing")["counts"]["done"] == 1


@pytest.mark.parametrize(
    ("table", "meets_it"),
    [
        ("group_state", "a maintenance task (the frontier updates it every second)"),
        # failed on ac05858: met by the fetcher (no claim can lock a row), the refusal
        # crashed the thread (a traceback; run() returned as if signalled)
        ("delivery", "the fetcher, woken by a publish"),
    ],
)
def test_a_privilege_revoked_while_it_runs_stops_the_member(
    orders, as_role, schema, caplog, table, meets_it
):
    role, eng = as_role()
    consumer = pgq.Consumer(eng, "billing", lambda m: None, **FAST)
    outcome: list[BaseException | pgq.RunSummary] = []

    def run() -> None:
        try:
            outcome.append(consumer.run())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="test-consumer", daemon=True)
    thread.start()
    try:
        wait_until(lambda: pgq.status(orders, "billing")["members"], 10, "the member to join")
        with orders.begin() as conn:
            conn.exec_driver_sql(f'REVOKE UPDATE ON "{schema}".{table} FROM "{role}"')
        pgq.publish(orders, "orders", {"n": 1})
        thread.join(15)
        assert not thread.is_alive(), f"the member did not stop ({meets_it})"
    finally:
        consumer.request_stop()
        thread.join(15)
    [result] = outcome
    assert isinstance(result, PermissionDenied), result
    assert f"UPDATE on {schema}.{table}" in str(result)
    assert "thread crashed" not in caplog.text
    assert not any(m["live"] for m in pgq.status(orders, "billing")["members"])
