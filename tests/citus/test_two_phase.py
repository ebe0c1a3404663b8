"""A distributed transaction becomes visible node by node on Citus: its parts are
prepared everywhere, then committed one node after the other, and a cut can leave
a part prepared until Citus recovers it. Each test here leaves such a part prepared
by hand on one worker (a transaction on the shard itself, `PREPARE TRANSACTION`)
and checks that pgq neither loses nor strands anything meanwhile: defects found by
attacking the cluster (docs/defects.md).

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from helpers import CITUS_DSN, across_groups, citus_marks, citus_worker_dsn
from psycopg import sql
from sqlalchemy import Engine, text

import pgq
from pgq.records import Outcome
from pgq.store import GroupStore, group_info, run_once

pytestmark = citus_marks()

LATE = 10**12
"""The id of the message whose commit is late on its node."""


@pytest.fixture
def cluster() -> Iterator[tuple[Engine, str]]:
    schema = f"pgq_2pc_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=4)
    pgq.migrate(engine, distributed=True)
    pgq.create_topic(engine, "t")
    try:
        yield engine, schema
    finally:
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextlib.contextmanager
def prepared_on_shard(
    schema: str, table: str, value: int, insert: str
) -> Iterator[psycopg.Connection]:
    """`insert` (with `{shard}` for the shard's name) run on the worker holding
    `table`'s shard for distribution value `value`, and left prepared; the
    connection is yielded to commit it (`COMMIT PREPARED` by `commit_prepared`),
    else it is rolled back at the end."""
    with psycopg.connect(CITUS_DSN) as coordinator:
        shard, port = coordinator.execute(
            "SELECT shard_name, nodeport FROM pg_catalog.citus_shards WHERE shardid ="
            " pg_catalog.get_shard_id_for_distribution_column(%s, %s)",
            [f"{schema}.{table}", value],
        ).fetchone()
    worker = psycopg.connect(citus_worker_dsn(port), autocommit=True)
    gid = f"pgq_test_{uuid.uuid4().hex}"
    worker.execute("BEGIN")
    worker.execute(insert.format(shard=shard))
    worker.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    worker.info_gid = gid  # type: ignore[attr-defined]
    try:
        yield worker
    finally:
        with contextlib.suppress(psycopg.Error):
            worker.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        worker.close()


def commit_prepared(worker: psycopg.Connection) -> None:
    gid = worker.info_gid  # type: ignore[attr-defined]
    worker.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))


def test_retention_leaves_a_message_whose_rows_are_still_committing(cluster):
    """The message is committed on its node, the group's row for it only prepared on
    the group's: retention's check of which groups hold it cannot see the row. It
    used to delete the message, and the row, committed later, named no message."""
    engine, schema = cluster
    [mid] = pgq.publish_many(engine, "t", [{"n": 1}])
    pgq.subscribe(engine, "g", "t", start="latest")
    gid = group_info(engine, "g").id
    insert = f"INSERT INTO {{shard}} (group_id, message_id) VALUES ({gid}, {mid})"
    with prepared_on_shard(schema, "delivery", gid, insert) as worker:
        store = GroupStore(gid, "g", "t", "retention", 30.0, 3)
        topic_id = group_info(engine, "g").topic_id
        assert run_once(engine, store.expire_messages, topic_id, 0.0) == 0
        commit_prepared(worker)
    with across_groups(engine) as conn:  # every group's
        rows = conn.execute(text(f'SELECT message_id FROM "{schema}".delivery')).scalars().all()
        messages = conn.execute(text(f'SELECT id FROM "{schema}".message')).scalars().all()
    assert rows == [mid] and messages == [mid]


def test_a_subscribe_waits_for_a_message_still_committing_on_its_node(cluster):
    """A publish committed on the coordinator, its message only prepared on the
    topic's node: an `earliest` subscribe used to backfill without it, and the group
    never got the message. It now waits for the commit and backfills it."""
    engine, schema = cluster
    pgq.publish_many(engine, "t", [{"n": 1}])
    with engine.connect() as conn:
        topic_id = conn.execute(text(f'SELECT id FROM "{schema}".topic')).scalar_one()
    insert = f"INSERT INTO {{shard}} (id, topic_id, payload) VALUES ({LATE}, {topic_id}, '7')"
    done = threading.Event()
    with prepared_on_shard(schema, "message", topic_id, insert) as worker:
        subscriber = threading.Thread(
            target=lambda: (pgq.subscribe(engine, "late", "t"), done.set())
        )
        subscriber.start()
        assert not done.wait(0.8), "the subscribe did not wait for the commit"
        commit_prepared(worker)
        subscriber.join(20)
    assert done.is_set()
    gid = group_info(engine, "late").id
    with engine.connect() as conn:
        rows = conn.execute(
            text(f'SELECT message_id FROM "{schema}".delivery WHERE group_id = :g ORDER BY 1'),
            {"g": gid},
        )
        assert rows.scalars().all()[-1] == LATE


def test_a_row_whose_message_is_not_visible_yet_is_put_back_uncharged(cluster):
    """The group's row is committed on the group's node, its message only prepared on
    the topic's: the claim leases the row and finds no message. It used to leave it
    leased until the lease ran out (a reclaim charged each time, then dead of
    `lease`, never handled). It is now put back, due a second later, uncharged, and
    claimed with its message once that commits."""
    engine, schema = cluster
    pgq.subscribe(engine, "g", "t")
    gid = group_info(engine, "g").id
    with engine.connect() as conn:
        topic_id = conn.execute(text(f'SELECT id FROM "{schema}".topic')).scalar_one()
    insert = f"INSERT INTO {{shard}} (id, topic_id, payload) VALUES ({LATE}, {topic_id}, '7')"
    with prepared_on_shard(schema, "message", topic_id, insert) as worker:
        with engine.begin() as conn:
            conn.execute(
                text(f'INSERT INTO "{schema}".delivery (group_id, message_id) VALUES (:g, :m)'),
                {"g": gid, "m": LATE},
            )
        store = GroupStore(gid, "g", "t", "m1", 30.0, 3)
        assert run_once(engine, store.claim, 10, 0) == []
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    f"SELECT state, attempts, reclaims, lease_owner, available_at > now()"
                    f' FROM "{schema}".delivery WHERE group_id = :g AND message_id = :m'
                ),
                {"g": gid, "m": LATE},
            ).one()
        assert tuple(row) == ("ready", 0, 0, None, True)
        commit_prepared(worker)
    with across_groups(engine) as conn:  # due now, by hand, every group's rows
        conn.execute(text(f'UPDATE "{schema}".delivery SET available_at = now()'))
    [claimed] = run_once(engine, store.claim, 10, 0)
    assert (claimed.id, claimed.message.payload) == (LATE, 7)
    assert run_once(engine, store.record, [Outcome(claimed, "done")]) == {claimed.lease}
