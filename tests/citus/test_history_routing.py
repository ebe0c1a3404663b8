"""A message's history on Citus (decision 0046): the statements that write its lines
(the failure write, the lease sweep, the close's reconciliation) and the read of the
message page each run as one task on the group's shard.

The statements run on an engine whose every connection sets
`citus.multi_task_query_log_level = error` (libpq `options`): a statement Citus would
split into several tasks fails instead of running. Time is moved by hand on another
connection (a lease expired, the breaker opened), as in
tests/integration/test_history.py.

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from helpers import CITUS_DSN, STRICT_CITUS_DSN, citus_marks
from psycopg import sql
from sqlalchemy import Engine, func, text, update

import pgq
from pgq import schema as t
from pgq.records import AttemptEvent, Outcome, OutcomeKind
from pgq.store import GroupStore, group_info, run_once
from pgq.store.history import message_history

pytestmark = citus_marks()

MAX_REFUNDS = 3


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    """(owner's engine, strict engine) on a distributed schema with topic `t` and
    groups `g` and `other` (so that `g` is not the only shard with rows)."""
    schema = f"pgq_hist_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=2)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        for group in ("g", "other"):
            pgq.subscribe(engine, group, "t")
        yield engine, strict
    finally:
        strict.dispose()
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_every_statement_that_writes_or_reads_a_history_is_one_task(engines):
    engine, strict = engines
    with strict.connect() as conn:
        assert conn.scalar(text("SHOW citus.multi_task_query_log_level")) == "error"
    [failing, reclaimed] = pgq.publish_many(engine, "t", [{"n": 1}, {"n": 2}])
    gid = group_info(engine, "g").id
    s = GroupStore(gid, "g", "t", "m", 30.0, 3)

    [first, second] = run_once(strict, s.claim, 2, 0)
    assert (first.id, second.id) == (failing, reclaimed)
    failed = Outcome(first, OutcomeKind.RETRY, 0.0, "systemic", "down", seconds=0.5)
    assert run_once(strict, s.record, [failed]) == {first.lease}

    with engine.begin() as conn:  # the second's lease expires; the breaker opens
        d = t.delivery
        conn.execute(
            update(d)
            .where(d.c.group_id == gid, d.c.message_id == reclaimed)
            .values(lease_expires_at=func.now() - text("interval '1 second'"))
        )
        conn.execute(
            update(t.breaker).where(t.breaker.c.group_id == gid).values(state="OPEN", epoch=1)
        )
    run_once(strict, s.sweep)

    close = run_once(strict, s.close, 1)
    view = run_once(strict, s.breaker)
    assert run_once(strict, s.reconcile_batch, close, view.reconcile_from, MAX_REFUNDS, 100) == 2
    assert run_once(strict, s.expire_history, 86400.0) == 0

    since = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    lines = message_history(strict, "g", failing, since).lines
    assert [x.event for x in lines] == [AttemptEvent.FAILED, AttemptEvent.REFUNDED]
    lines = message_history(strict, "g", reclaimed, since).lines
    assert [(x.event, x.member) for x in lines] == [
        (AttemptEvent.RECLAIMED, "m"),
        (AttemptEvent.REFUNDED, "m"),
    ]
