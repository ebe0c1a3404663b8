"""Joining a group under a name (`GroupStore.join`): who gets the name, and when.

A join is two statements (insert a new row, else take the existing row over:
decision 0023, section 6, because Citus refuses `now()` in `ON CONFLICT DO
UPDATE`). What one statement guaranteed must still hold: a name whose row was
heard from within the ttl is refused unless the caller holds the name's session
lock; a silent or departed row is taken over; of concurrent starters exactly one
joins; a row deleted between the two statements does not refuse the join.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from helpers import wait_until
from sqlalchemy import Engine, event, func, insert, select, text, update

import pgq
from pgq import schema as t
from pgq.store import GroupStore, run_once

TTL = 30.0
STARTERS = 4


@pytest.fixture
def gid(engine: Engine) -> int:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    with engine.connect() as conn:
        return int(conn.scalar(select(t.consumer_group.c.id).where(t.consumer_group.c.name == "g")))


def store(gid: int) -> GroupStore:
    return GroupStore(gid, "g", "t", "svc", 30.0, 3)


def join(engine: Engine, gid: int, takeover: bool = False) -> tuple[bool, Any]:
    """Join as `svc`; (joined, the started_at this process got)."""
    s = store(gid)
    joined = run_once(engine, s.join, TTL, takeover)
    return joined, s.started


def member_row(engine: Engine, gid: int) -> Any:
    with engine.connect() as conn:
        m = t.member
        return conn.execute(select(m).where(m.c.group_id == gid, m.c.name == "svc")).one_or_none()


def make_silent(engine: Engine, gid: int, seconds: float, left: bool = False) -> None:
    """The row of `svc` last heard from `seconds` ago (and left then, with `left`),
    its local breaker open under epoch 3."""
    ago = func.now() - dt.timedelta(seconds=seconds)
    m = t.member
    with engine.begin() as conn:
        conn.execute(
            update(m)
            .where(m.c.group_id == gid, m.c.name == "svc")
            .values(
                last_seen=ago, left_at=ago if left else None, local_breaker="open", tripped_epoch=3
            )
        )


def test_a_name_heard_from_is_refused_unless_the_caller_holds_its_lock(engine, gid):
    joined, started = join(engine, gid)
    assert joined
    before = member_row(engine, gid)
    assert join(engine, gid) == (False, None)
    assert member_row(engine, gid) == before  # a refused join changes nothing
    joined, again = join(engine, gid, takeover=True)
    assert joined
    assert again > started == before.started_at
    assert member_row(engine, gid).started_at == again


@pytest.mark.parametrize("left", [False, True], ids=["silent", "left"])
def test_a_silent_or_departed_row_is_taken_over_and_reset(engine, gid, left):
    assert join(engine, gid)[0]
    make_silent(engine, gid, TTL + 5, left=left)
    joined, started = join(engine, gid)
    assert joined
    row = member_row(engine, gid)
    assert (row.started_at, row.last_seen, row.left_at) == (started, started, None)
    assert (row.local_breaker, row.tripped_epoch) == ("closed", None)


def start_joins(engine: Engine, gid: int, schema: str) -> tuple[list[bool], list[threading.Thread]]:
    """Start `STARTERS` joins of `svc`; returns once all of them wait on a lock
    (the caller holds it in an open transaction), with the list their results go to."""
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(join(engine, gid)[0]))
        for _ in range(STARTERS)
    ]
    for thread in threads:
        thread.start()

    def waiting() -> int:
        with engine.connect() as conn:
            return int(
                conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND strpos(query, :schema) > 0"
                    ),
                    {"schema": schema},
                )
            )

    wait_until(lambda: waiting() == STARTERS, 10, "every starter to wait")
    return results, threads


def finish(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)


def test_of_concurrent_starters_of_a_new_name_exactly_one_joins(engine, gid, schema):
    """They all wait for a transaction inserting the name, which then rolls back."""
    with engine.connect() as side:
        side.execute(insert(t.member).values(group_id=gid, name="svc", host="x", pid=1))
        results, threads = start_joins(engine, gid, schema)
        side.rollback()
    finish(threads)
    assert sorted(results) == [False] * (STARTERS - 1) + [True]
    assert member_row(engine, gid) is not None


def test_of_concurrent_takeovers_of_a_silent_row_exactly_one_joins(engine, gid, schema):
    """They all find the row silent and wait for a transaction holding its lock."""
    assert join(engine, gid)[0]
    make_silent(engine, gid, TTL + 5)
    m = t.member
    with engine.connect() as side:
        side.execute(select(m).where(m.c.group_id == gid).with_for_update())
        results, threads = start_joins(engine, gid, schema)
        side.commit()
    finish(threads)
    assert sorted(results) == [False] * (STARTERS - 1) + [True]


def test_a_row_deleted_between_the_two_statements_does_not_refuse_the_join(engine, gid):
    """`forget_departed` may delete a long-departed row after the insert found it and
    before the takeover: the name is then free, and the join must get it."""
    assert join(engine, gid)[0]
    make_silent(engine, gid, 3600, left=True)
    deleted: list[int] = []

    def forget(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "ON CONFLICT" in statement and "member" in statement and not deleted:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:
                m = t.member
                result = other.execute(m.delete().where(m.c.group_id == gid))
                deleted.append(result.rowcount)

    event.listen(engine, "after_cursor_execute", forget)
    try:
        joined, started = join(engine, gid)
    finally:
        event.remove(engine, "after_cursor_execute", forget)
    assert deleted == [1]
    assert joined
    assert member_row(engine, gid).started_at == started
