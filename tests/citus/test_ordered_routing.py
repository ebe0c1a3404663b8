"""Ordered groups on Citus (decision 0044): the claim's key rule (`key_free`: the
group's leased keys, the earlier rows of a key, the lookahead window) and an ordered
group's requeue lock (`lock_key_successors`) read only the group's own shard, so each
statement is one task.

The members' engine sets `citus.multi_task_query_log_level = error` on every
connection (libpq `options`): a statement Citus would split into several tasks fails
instead of running. An ordered group of many keys must drain with no such error,
each key's messages handled one at a time in publish order, by the plain consumer and
by the transactional one (a batch handler: no batch holds two messages of a key).

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import CITUS_DSN, STRICT_CITUS_DSN, KeyRuns, citus_marks
from psycopg import sql
from sqlalchemy import Engine, text, update

import pgq
from pgq import schema as t
from pgq.store import group_info, requeue

pytestmark = citus_marks()

N = 160
KEYS = 8


@contextlib.contextmanager
def cluster() -> Iterator[tuple[Engine, str, dict[str, list[int]]]]:
    """A distributed schema with topic `t`, ordered group `g` and `N` messages of `KEYS`
    keys, published interleaved in a few transactions; the ids per key in order."""
    schema = f"pgq_ord_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        pgq.subscribe(engine, "g", "t", ordered=True)
        published: dict[str, list[int]] = defaultdict(list)
        for lo in range(0, N, 40):
            with engine.begin() as conn:
                for i in range(lo, lo + 40):
                    key = f"k{(i * 7) % KEYS}"
                    published[key].append(pgq.publish(conn, "t", {"i": i}, key=key))
        yield engine, schema, published
    finally:
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def drain(
    engine: Engine, schema: str, caplog: pytest.LogCaptureFixture, **kwargs: Any
) -> pgq.RunSummary:
    """Drain `g` on an engine whose every connection refuses multi-task statements;
    fail on any log line that says one was refused."""
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=4)
    try:
        with strict.connect() as conn:
            assert conn.scalar(text("SHOW citus.multi_task_query_log_level")) == "error"
        with caplog.at_level(logging.DEBUG, logger="pgq"):
            consumer = pgq.Consumer(strict, "g", workers=4, poll_interval=0.1, **kwargs)
            summary = consumer.run(until_empty=True, max_runtime=90)
        assert consumer.clean
        # an ordered group's requeue on the strict engine: its lock of the key's later
        # rows is one task too
        d = t.delivery
        dead, later = (pgq.publish(engine, "t", {"i": i}, key="k0") for i in (N, N + 1))
        gid = group_info(engine, "g").id
        with engine.begin() as conn:
            conn.execute(
                update(d)
                .where(d.c.group_id == gid, d.c.message_id == dead)
                .values(state="dead", error_class="permanent")
            )
        assert later > dead
        assert requeue(strict, "g", [dead], reason="citus").count == 1
    finally:
        strict.dispose()
    refused = [r.getMessage() for r in caplog.records if re.search("multi-task", r.getMessage())]
    assert refused == []
    return summary


def test_an_ordered_group_drains_with_every_statement_single_task(caplog):
    with cluster() as (engine, schema, published):
        handled = KeyRuns()

        summary = drain(engine, schema, caplog, handler=handled.one)
        assert summary.done == N and summary.dead == 0, summary
        handled.check(published)


def test_a_transactional_batch_handler_keeps_the_order_on_citus(caplog):
    with cluster() as (engine, schema, published):
        handled = KeyRuns()

        summary = drain(
            engine, schema, caplog, transactional=True, batch_handler=handled.batch, batch_size=16
        )
        assert summary.done == N and summary.dead == 0, summary
        handled.check(published)
        assert max(len(b) for b in handled.batches) > 1, handled.batches
