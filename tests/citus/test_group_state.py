"""A topic with two groups on different workers, on Citus: what a group's shard does
for it (decision 0023, sections 3.4, 4 and 5).

Publishing writes each group's rows on its worker with that worker's xid (the
trigger); acks, the frontier's advance, its prune and the counters run on the
group's shard; retention deletes a message only once every group's frontier has
passed and pruned it; the topic locks are the coordinator's advisory locks, per
topic. The claim does not run on Citus yet, so rows are leased by hand and acked
with the production statement. Needs `PGQ_CITUS_DSN`; skipped without it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from helpers import CITUS_DSN, across_groups, citus_marks
from psycopg import sql
from sqlalchemy import Connection, Engine, text

import pgq
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import outcomes
from pgq.store import GroupStore
from pgq.store.topics import group_info

pytestmark = citus_marks()

_names = itertools.count()


def schema_of(engine: Engine) -> str:
    return str(engine.get_execution_options()["schema_translate_map"][SCHEMA_PLACEHOLDER])


def node_of(engine: Engine, gid: int) -> int:
    """The port of the worker holding group `gid`'s shard of `delivery`."""
    with engine.connect() as conn:
        return int(
            conn.scalar(
                text(
                    "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid ="
                    " get_shard_id_for_distribution_column(:table, :gid)"
                ),
                {"table": f'"{schema_of(engine)}".delivery', "gid": gid},
            )
        )


def gid_of(engine: Engine, group: str) -> int:
    return group_info(engine, group).id


@contextlib.contextmanager
def two_workers() -> Iterator[tuple[Engine, int, int]]:
    """A distributed schema with topic `orders` and groups `a` and `b` on it, whose
    shards are on different workers (groups of a topic `spare` take the ids between);
    yields the engine and the two group ids. Dropped afterwards."""
    schema = f"pgq_state_{os.getpid()}_{next(_names)}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=3)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "orders")
        pgq.create_topic(engine, "spare")
        pgq.subscribe(engine, "a", "orders")
        a = gid_of(engine, "a")
        spare = 0
        while node_of(engine, a + spare + 1) == node_of(engine, a):
            spare += 1
            pgq.subscribe(engine, f"spare{spare}", "spare")
        pgq.subscribe(engine, "b", "orders")
        b = gid_of(engine, "b")
        assert node_of(engine, a) != node_of(engine, b)
        yield engine, a, b
    finally:
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def ack(engine: Engine, gid: int, ids: list[int]) -> None:
    """Lease `ids` of group `gid` by hand (the claim does not run here yet), then ack
    them with the production statement, one batch each: a batch keeps its last row
    (marked done) and deletes the others, so a batch of one keeps every row for the
    frontier to pass and prune here."""
    s = schema_of(engine)
    with engine.begin() as conn:
        leased = conn.execute(
            text(
                f"UPDATE \"{s}\".delivery SET state = 'leased', lease_owner = 'm1',"
                " lease_seq = message_id + 1000, lease_expires_at = now() + interval '1 min'"
                " WHERE group_id = :gid AND message_id = ANY(:ids) RETURNING message_id, lease_seq"
            ),
            {"gid": gid, "ids": ids},
        ).all()
        assert len(leased) == len(ids)
        for mid, seq in leased:
            params = {"gid": gid, "member": "m1", "ids": [mid], "seqs": [seq]}
            assert len(conn.execute(outcomes.ack_done(), params).all()) == 1


def frontier(engine: Engine, gid: int) -> tuple[int | None, int]:
    """Group `gid`'s frontier id and done_pruned, from `group_state`."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                f'SELECT committed_id, done_pruned FROM "{schema_of(engine)}".group_state'
                " WHERE group_id = :gid"
            ),
            {"gid": gid},
        ).one()
    return row.committed_id, int(row.done_pruned)


def advance(engine: Engine, gid: int, to: int) -> int:
    """Advance group `gid`'s frontier until it reaches message `to` (a transaction
    open elsewhere in the database on that worker holds its xmin back: another test
    run on the same cluster may, for a while); the rows pruned."""
    store = GroupStore(gid, "", "orders", "m1", 30.0, 3)
    pruned, deadline = 0, time.monotonic() + 60
    while frontier(engine, gid)[0] != to:
        assert time.monotonic() < deadline, (
            f"the frontier of {gid} stays at {frontier(engine, gid)}"
        )
        with engine.begin() as conn:
            pruned += store.advance_frontier(conn) or 0
        time.sleep(0.05)
    return pruned


def expire(engine: Engine, topic_id: int, limit: int = 100) -> int:
    """One retention batch of `orders` (retention 0: every message has expired)."""
    store = GroupStore(0, "", "orders", "m1", 30.0, 3)
    with engine.begin() as conn:
        return store.expire_messages(conn, topic_id, 0.0, limit)


def messages(engine: Engine) -> list[int]:
    with across_groups(engine) as conn:  # every topic's
        return list(conn.scalars(text(f'SELECT id FROM "{schema_of(engine)}".message ORDER BY id')))


def local_xid(conn: Connection, schema: str, gid: int) -> list[bool]:
    """For each row of group `gid`: is its xid this transaction's on the group's worker?"""
    return list(
        conn.scalars(
            text(
                f'SELECT xid = pg_current_xact_id() FROM "{schema}".delivery WHERE group_id = :gid'
            ),
            {"gid": gid},
        )
    )


def test_two_groups_on_two_workers_ack_advance_prune_and_expire():
    with two_workers() as (engine, a, b):
        s = schema_of(engine)
        topic_id = group_info(engine, "a").topic_id
        with engine.begin() as conn:
            ids = pgq.publish_many(conn, "orders", [{"n": i} for i in range(4)])
            # the trigger gave each row the xid of the worker transaction inserting it
            assert local_xid(conn, s, a) == local_xid(conn, s, b) == [True] * 4
        first, second, third, last = ids

        ack(engine, a, ids)
        ack(engine, b, [first, third])
        with engine.begin() as conn:  # b's second row died: resolved, kept
            conn.execute(
                text(
                    f"UPDATE \"{s}\".delivery SET state = 'dead', error_class = 'message'"
                    " WHERE group_id = :gid AND message_id = :id"
                ),
                {"gid": b, "id": second},
            )
        assert advance(engine, a, last) == 4
        assert advance(engine, b, third) == 2  # past the dead row, up to the ready one
        assert frontier(engine, a) == (last, 4)
        assert frontier(engine, b) == (third, 2)

        # b still holds the second (dead) and the last (ready); batches of one: the
        # second batch pages past the held second message to the third
        assert expire(engine, topic_id, limit=1) == 1
        assert messages(engine) == [second, third, last]
        assert expire(engine, topic_id, limit=1) == 1
        assert messages(engine) == [second, last]
        assert expire(engine, topic_id) == 0

        # the dead row comes back and is done behind the frontier: prune_behind
        ack(engine, b, [second])
        with engine.begin() as conn:
            assert GroupStore(b, "b", "orders", "m1", 30.0, 3).prune_behind(conn) == 1
        assert frontier(engine, b) == (third, 3)
        assert expire(engine, topic_id) == 1
        assert messages(engine) == [last]

        ack(engine, b, [last])
        assert advance(engine, b, last) == 1
        assert frontier(engine, b) == (last, 4)
        assert expire(engine, topic_id) == 1
        assert messages(engine) == []


def test_publishing_locks_only_its_own_topic():
    """A transaction that published to `orders` and stays open does not hold up a
    publish to another topic (a row lock on the reference table `topic` did: 0023
    3.4), and a subscribe to `orders` waits for it, then backfills what it published."""
    with two_workers() as (engine, _, _):
        with engine.connect() as conn:
            with conn.begin():
                held = pgq.publish(conn, "orders", {"n": 1})
                elsewhere = threading.Thread(target=pgq.publish, args=(engine, "spare", {}))
                elsewhere.start()
                elsewhere.join(3.0)
                assert not elsewhere.is_alive(), "a publish to another topic waited"
                subscribed: list[Any] = []

                def subscribe() -> None:
                    try:
                        subscribed.append(pgq.subscribe(engine, "late", "orders"))
                    except Exception as exc:
                        subscribed.append(exc)

                late = threading.Thread(target=subscribe)
                late.start()
                late.join(1.0)
                assert late.is_alive(), "the subscribe did not wait for the open publish"
            late.join(10)
        assert subscribed == [None]
        with engine.connect() as conn:
            backfilled = conn.scalars(
                text(f'SELECT message_id FROM "{schema_of(engine)}".delivery WHERE group_id = :g'),
                {"g": gid_of(engine, "late")},
            ).all()
        assert list(backfilled) == [held]
