"""The charts' samples on Citus (decision 0045): `group_sample` is placed with the
group's rows, and every statement a member or the dashboard's sampler runs on it
(the minute's test and numbers, the write, retention) is one task on the group's
node: on an engine whose connections refuse multi-task statements, a member writes
its group's sample and prunes the old ones, and the sampler writes the others'.

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import uuid

import psycopg
from helpers import CITUS_DSN, FAST, STRICT_CITUS_DSN, citus_marks, wait_until
from psycopg import sql
from sqlalchemy import func, insert, select, text

import pgq
from pgq import schema as t
from pgq.store import group_info
from pgq.store.samples import sample_every_group

pytestmark = citus_marks()


def test_members_and_the_sampler_write_and_prune_samples_one_task_each(caplog):
    schema = f"pgq_smp_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=4)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        for group in ("g", "h"):
            pgq.subscribe(engine, group, "t")
        pgq.publish_many(engine, "t", [{"i": i} for i in range(20)])
        s = t.group_sample
        gid = group_info(engine, "g").id
        with engine.begin() as conn:
            old = conn.scalar(select(func.date_trunc("minute", func.now() - dt.timedelta(days=2))))
            conn.execute(insert(s).values(group_id=gid, at=old, done=0, lag=1, dead=0))

        def rows(group: str) -> list[dt.datetime]:
            with engine.connect() as conn:
                found = select(s.c.at).where(s.c.group_id == group_info(engine, group).id)
                return list(conn.execute(found).scalars())

        with strict.connect() as conn:
            assert conn.scalar(text("SHOW citus.multi_task_query_log_level")) == "error"
        with caplog.at_level(logging.DEBUG, logger="pgq"):
            consumer = pgq.Consumer(strict, "g", lambda msg: None, **FAST)
            consumer.start()
            try:
                wait_until(lambda: rows("g") and old not in rows("g"), 30, "g's sample, pruned")
            finally:
                consumer.stop(timeout=10)
            # h's (and g's too, when a new minute began meanwhile)
            assert sample_every_group(strict) >= 1
        assert len(rows("h")) == 1
        said = [r.getMessage() for r in caplog.records]
        refused = [line for line in said if re.search("multi-task", line)]
        assert refused == []
    finally:
        strict.dispose()
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
