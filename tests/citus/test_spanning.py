"""The statements of pgq that span shards on purpose (`pgq.store.placement.Spanning`)
run on an engine whose every connection refuses a multi-task statement
(`citus.multi_task_query_log_level = error`), each inside its named `spanning`
block, and the per-group reads next to them stay one task.

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from helpers import CITUS_DSN, STRICT_CITUS_DSN, citus_marks
from psycopg import sql
from sqlalchemy import Engine, text

import pgq
from pgq import monitor
from pgq.store.samples import all_samples, group_samples, sample_every_group

pytestmark = citus_marks()


@pytest.fixture
def strict() -> Iterator[Engine]:
    """A strict engine on a distributed schema with topics `t` and `u`, groups `g`
    and `h` on `t` and `k` on `u`, messages on both topics."""
    schema = f"pgq_span_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=2)
    try:
        pgq.migrate(engine, distributed=True)
        for topic in ("t", "u"):
            pgq.create_topic(engine, topic)
        for group, topic in (("g", "t"), ("h", "t"), ("k", "u")):
            pgq.subscribe(engine, group, topic)
        pgq.publish_many(engine, "t", [{"n": n} for n in range(3)], delay=3600)
        pgq.publish_many(engine, "u", [{"n": n} for n in range(2)])
        engine.dispose()
        yield strict
    finally:
        strict.dispose()
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_the_named_spanning_statements_run_on_a_strict_engine(strict):
    with strict.connect() as conn:
        assert conn.scalar(text("SHOW citus.multi_task_query_log_level")) == "error"
    # SUBSCRIBE_BACKFILL: the delays of the topic's messages, from every group's rows
    pgq.subscribe(strict, "late", "t", start="earliest")
    # GROUPS_OVERVIEW and MEMBERS_OVERVIEW
    overview = monitor.status_all(strict)
    assert [g["group"] for g in overview["groups"]] == ["g", "h", "k", "late"]
    assert {g["group"]: g["counts"]["ready"] for g in overview["groups"]}["late"] == 3
    # TOPIC_MESSAGE_COUNTS
    assert {x.name: x.messages for x in pgq.topics(strict).topics} == {"t": 3, "u": 2}
    # SAMPLES_OVERVIEW
    assert sample_every_group(strict) == 4
    assert set(all_samples(strict, 3600.0)) == {"g", "h", "k", "late"}
    # AUDIT_BY_NAME: of a topic, and of a group removed
    pgq.unsubscribe(strict, "h", reason="test")
    assert [r["action"] for r in monitor.audit(strict, None, topic="t")] == ["unsubscribe"]
    assert [r["action"] for r in monitor.audit(strict, "h")] == ["unsubscribe"]


def test_one_groups_reads_need_no_spanning(strict):
    status = monitor.status(strict, "g")
    assert status["counts"]["ready"] == 3
    assert monitor.members(strict, "g") == []
    assert group_samples(strict, "g", 3600.0) == []
    assert monitor.audit(strict, "g") == []
