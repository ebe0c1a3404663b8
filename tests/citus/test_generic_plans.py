"""A group's statements stay one task once PostgreSQL plans them generically.

psycopg prepares a statement after its 5th run on a connection, and PostgreSQL
tries the prepared statement's generic plan from its 11th run on. There the
parameters have no values: Citus routes on `group_id = $n` only when `$n` is the
parameter itself. psycopg sent a small Python `int` as `smallint`, which under
SQLAlchemy's `$n::INTEGER` became `int4($n)`, and from its 11th run the probe's
slot renewal (`UPDATE breaker SET next_probe_at = now() + $1 WHERE group_id =
$2::INTEGER ...`) ran on every shard; `pgq.connect` now sends such an `int` as
`integer` (`pgq.store.engine`).

Each statement a member repeats on its connections runs here 15 times on one
connection of an engine whose every connection refuses a multi-task statement
(`citus.multi_task_query_log_level = error`): the probe (slot, renewal, outcome),
the failure write, the open, the close, the heartbeat's breaker read.

Needs `PGQ_CITUS_DSN` (see test_placement.py); skipped without it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import CITUS_DSN, STRICT_CITUS_DSN, citus_marks
from psycopg import sql
from sqlalchemy import Connection, Engine, text, update

import pgq
from pgq import schema as t
from pgq.records import Outcome, OutcomeKind
from pgq.store import GroupStore, group_info

pytestmark = citus_marks()

RUNS = 15
"""Past the 11th run, where PostgreSQL takes a prepared statement's generic plan."""


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    """(owner's engine, strict engine of one connection) on a distributed schema with
    topic `t` and groups `g` and `other`."""
    schema = f"pgq_gen_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    strict = pgq.connect(STRICT_CITUS_DSN, schema=schema, pool_size=1, max_overflow=0)
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


def repeated(strict: Engine, step: Callable[[Connection], Any]) -> None:
    """`step` `RUNS` times, each in a transaction of its own on the one connection."""
    for n in range(RUNS):
        with strict.begin() as conn:
            try:
                step(conn)
            except Exception as e:
                raise AssertionError(f"run {n}") from e


def test_the_breakers_statements_stay_on_the_groups_shard_when_planned_generically(engines):
    engine, strict = engines
    with strict.connect() as conn:
        assert conn.scalar(text("SHOW citus.multi_task_query_log_level")) == "error"
    gid = group_info(engine, "g").id
    s = GroupStore(gid, "g", "t", "m", 30.0, 3)
    with engine.begin() as conn:  # an outage at epoch 1
        b = t.breaker
        conn.execute(update(b).where(b.c.group_id == gid).values(state="OPEN", epoch=1))

    repeated(strict, s.breaker)
    repeated(strict, lambda c: s.renew_probe(c, 1, 5.0))
    repeated(strict, lambda c: s.probe_again(c, 1, 0.0))
    repeated(strict, lambda c: s.probe_again(c, 1, 0.0, "inconclusive", None, None))
    repeated(strict, lambda c: s.probe_failed(c, 1, 0.0, None))
    repeated(strict, lambda c: s.claim_probe(c, 1, 3, 5.0))  # nothing to probe: None
    repeated(strict, lambda c: s.close(c, 0))  # not OPEN at epoch 0: nothing
    repeated(strict, lambda c: s.close_idle(c, 0, 3))  # not OPEN at epoch 0
    opened = 0
    for _ in range(RUNS):  # not CLOSED at epoch 1: nothing opens
        with strict.begin() as conn:
            opened += s.open_on_quorum(conn, 1, ttl=30.0, min_members=1, quorum=0.5) is not None
    assert opened == 0


def test_the_failure_write_stays_on_the_groups_shard_when_planned_generically(engines):
    engine, strict = engines
    gid = group_info(engine, "g").id
    s = GroupStore(gid, "g", "t", "m", 30.0, 3)
    ids = pgq.publish_many(engine, "t", [{"n": n} for n in range(RUNS)])
    for _ in range(RUNS):
        with strict.begin() as conn:
            [row] = s.claim(conn, 1, 0)
            failed = Outcome(row, OutcomeKind.RETRY, 3600.0, "systemic", "down", seconds=0.1)
            assert s.record(conn, [failed]) == {row.lease}
    with engine.connect() as conn:
        d = t.delivery
        failed_ids = conn.scalars(
            d.select()
            .with_only_columns(d.c.message_id)
            .where(d.c.group_id == gid, d.c.error_class == "systemic")
        ).all()
    assert sorted(failed_ids) == sorted(ids)


def test_an_outage_with_nothing_to_probe_closes_on_the_cluster(engines):
    # Citus refused the idle close's `coalesce(next_probe_at <= now(), true)` in an
    # UPDATE ("non-IMMUTABLE functions are not allowed in CASE or COALESCE")
    engine, strict = engines
    gid = group_info(engine, "g").id
    s = GroupStore(gid, "g", "t", "m", 30.0, 3)
    with engine.begin() as conn:
        b = t.breaker
        conn.execute(update(b).where(b.c.group_id == gid).values(state="OPEN", epoch=1))
    with strict.begin() as conn:
        assert s.close_idle(conn, 1, 3) == 2
    with strict.begin() as conn:
        assert s.breaker(conn).state == "CLOSED"
