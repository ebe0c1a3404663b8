"""Transactional handlers on Citus (decision 0042, issue 22): the handler's writes and
pgq's ack in one distributed transaction, every pgq statement of it (and of the
member around it) one task.

The effect table is what a user has on a cluster: their own table, distributed by a
column of theirs that the handler sets from the payload (`account`), not co-located
with pgq's `delivery` (distributed by group). The consumer's engine sets
`citus.multi_task_query_log_level = error` on every connection it opens (libpq
`options`, so the member's own connections and the handlers' alike): a statement Citus
would split into several tasks fails instead of running. The drain must end with every
message done once and its effect row there once.

A single-message handler's `INSERT` of one row is one task. A batch handler's
multi-row `INSERT` writes to several of the accounts' shards; Citus 13.2 runs it
without consulting the setting (only statements planned as several tasks are
refused, e.g. a `SELECT count(*)` of the table), so the handlers need nothing
special. The transaction then writes on two nodes or more (the group's and the
accounts'): Citus commits it with two-phase commit, atomically (the single test sees
its `PREPARE TRANSACTION`).

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import CITUS_DSN, STRICT_CITUS_DSN, across_groups, citus_marks
from psycopg import sql
from sqlalchemy import Connection, Engine, text

import pgq

pytestmark = citus_marks()

N = 120
ACCOUNTS = 16
"""Distinct values of the effect table's distribution column (over its 32 shards)."""


@contextlib.contextmanager
def cluster() -> Iterator[tuple[Engine, str]]:
    """A distributed pgq schema with topic `t`, group `g` and `N` messages (each with
    its `account`), and beside it `effect` distributed by `account`. Dropped after."""
    schema = f"pgq_tx_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        pgq.subscribe(engine, "g", "t")
        with engine.begin() as conn:
            conn.execute(
                text(
                    f'CREATE TABLE "{schema}".effect (account int NOT NULL,'
                    " message_id bigint NOT NULL, PRIMARY KEY (account, message_id))"
                )
            )
            conn.execute(
                text("SELECT create_distributed_table(:t, 'account')"),
                {"t": f'"{schema}".effect'},
            )
        pgq.publish_many(engine, "t", [{"account": i % ACCOUNTS, "i": i} for i in range(N)])
        yield engine, schema
    finally:
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def insert_effect(schema: str) -> Any:
    return text(f'INSERT INTO "{schema}".effect (account, message_id) VALUES (:a, :m)')


def drain(
    engine: Engine, schema: str, caplog: pytest.LogCaptureFixture, **handlers: Any
) -> pgq.RunSummary:
    """Drain `g` on an engine whose every connection refuses multi-task statements;
    fail on any log line that says one was refused."""
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=4)
    try:
        with strict.connect() as conn:  # the setting holds on the engine's connections
            level = conn.scalar(text("SHOW citus.multi_task_query_log_level"))
        assert level == "error"
        with caplog.at_level(logging.DEBUG, logger="pgq"):
            consumer = pgq.Consumer(
                strict,
                "g",
                transactional=True,
                workers=4,
                batch_size=25,
                poll_interval=0.1,
                **handlers,
            )
            summary = consumer.run(until_empty=True, max_runtime=60)
        assert consumer.clean
    finally:
        strict.dispose()
    refused = [r.getMessage() for r in caplog.records if re.search("multi-task", r.getMessage())]
    assert refused == []
    return summary


def check_drained(engine: Engine, schema: str, summary: pgq.RunSummary) -> None:
    """Every message done once; its effect row there once, with the message's account."""
    assert summary.stop_reason == "empty", summary
    assert summary.done == N and summary.retried == 0 and summary.dead == 0, summary
    s = pgq.status(engine, "g")
    assert s["counts"] == {"ready": 0, "leased": 0, "done": N, "dead": 0, "dead_systemic": 0}
    with across_groups(engine) as conn:  # every account's
        effects = conn.execute(
            text(f'SELECT message_id, account FROM "{schema}".effect ORDER BY 1')
        ).all()
        messages = conn.execute(
            text(f"SELECT id, (payload->>'account')::int FROM \"{schema}\".message ORDER BY 1")
        ).all()
    assert [tuple(r) for r in effects] == [tuple(r) for r in messages]
    assert len(effects) == N


def test_single_message_handler_drains_with_every_statement_single_task(caplog):
    with cluster() as (engine, schema):
        insert = insert_effect(schema)

        levels: set[str] = set()
        remote: list[str] = []
        heard: set[int] = set()

        def handle(msg: pgq.Message, conn: Connection) -> None:
            levels.add(conn.scalar(text("SHOW citus.multi_task_query_log_level")))
            driver = conn.connection.driver_connection
            assert driver is not None
            if id(driver) not in heard:  # what Citus sends the workers, commit included
                heard.add(id(driver))
                driver.add_notice_handler(lambda d: remote.append(d.message_primary or ""))
            conn.execute(text("SET LOCAL citus.log_remote_commands = on"))
            conn.execute(insert, {"a": msg.payload["account"], "m": msg.id})

        check_drained(engine, schema, drain(engine, schema, caplog, handler=handle))
        assert levels == {"error"}  # the handlers' connections are strict too
        # an effect on another node than the group's: the commit is two-phase
        assert any(c.startswith("issuing PREPARE TRANSACTION") for c in remote), remote[:20]


def test_batch_handler_drains_with_every_pgq_statement_single_task(caplog):
    with cluster() as (engine, schema):
        insert = insert_effect(schema)
        sizes: list[int] = []

        def handle(msgs: list[pgq.Message], conn: Connection) -> None:
            conn.execute(insert, [{"a": m.payload["account"], "m": m.id} for m in msgs])
            sizes.append(len(msgs))

        check_drained(engine, schema, drain(engine, schema, caplog, batch_handler=handle))
        assert sum(sizes) == N and max(sizes) > 1, sizes
