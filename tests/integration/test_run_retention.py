"""A run that was due a retention pass does it before it returns (issue 20, defect 3).

DESIGN §3: members run retention in their maintenance when they start and then
about once a minute; §7: a last maintenance pass runs before a run returns. A
`run(until_empty=True)` with nothing to do drains in milliseconds; its stop used
to reach the maintenance thread before the start-up round got to retention,
which then gave up at once: 2 of 8 such runs deleted nothing. The final pass now
runs the retention pass the run was due and did not complete.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST, consumer_env, finish, spawn_pgq, wait_until
from sqlalchemy import Engine, func, select, update

import pgq
from pgq import schema as t
from pgq.consumer.maintenance import EXPIRE_BUDGET, HOUSEKEEPING_LOCK_TIMEOUT
from pgq.store.group import GroupStore

RUNS = 8
"""In-process runs, each one due its start-up retention pass."""

CLI_RUNS = 3
"""`pgq consume --until-empty` runs (before the fix 2 of 4 deleted nothing)."""

CLI_SETTINGS = {
    "PGQ_WORKERS": 2,
    "PGQ_RETENTION": 60,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": 1.0,
}


def message_ids(engine: Engine, topic: str) -> set[int]:
    """The ids of the messages `topic` still holds."""
    m, tp = t.message, t.topic
    with engine.connect() as conn:
        found = conn.execute(
            select(m.c.id).join(tp, tp.c.id == m.c.topic_id).where(tp.c.name == topic)
        )
        return set(found.scalars())


def finish_and_expire(engine: Engine, topic: str, group: str, ids: list[int]) -> None:
    """Have `group` finish messages `ids` (a run handles them), the frontier pass
    them (their rows pruned: no group holds the messages any more), and make
    them an hour old: they are retention's to delete, and the next run is due
    to delete them at its start."""
    summary = pgq.Consumer(engine, group, lambda msg: None, workers=2, **FAST).run(until_empty=True)
    assert summary.stop_reason == "empty"
    g, gs = t.consumer_group, t.group_state
    with engine.connect() as conn:
        gid = conn.execute(select(g.c.id).where(g.c.name == group)).scalar_one()
    store = GroupStore(gid, group, topic, "test", 30.0, 3)

    def passed() -> bool:  # another session's transaction may hold the frontier back
        with engine.begin() as conn:
            store.advance_frontier(conn)
            committed = conn.execute(select(gs.c.committed_id).where(gs.c.group_id == gid)).scalar()
            left = conn.execute(select(func.count()).where(t.delivery.c.group_id == gid))
            return committed == max(ids) and left.scalar() == 0

    wait_until(passed, 30, "the frontier to pass the finished messages")
    with engine.begin() as conn:
        conn.execute(
            update(t.message)
            .where(t.message.c.id.in_(ids))
            .values(created_at=func.now() - func.make_interval(0, 0, 0, 0, 1))
        )


def test_a_run_that_drains_at_once_still_runs_its_retention_pass(engine: Engine) -> None:
    """Every one of `RUNS` runs deletes the expired messages before it returns."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    settings: dict[str, Any] = {"workers": 2, "retention": 60.0, **FAST}
    kept: list[tuple[int, set[int]]] = []
    for run in range(RUNS):
        ids = pgq.publish_many(engine, "t", [{"run": run, "i": i} for i in range(20)])
        finish_and_expire(engine, "t", "g", ids)
        assert set(ids) <= message_ids(engine, "t")
        summary = pgq.Consumer(engine, "g", lambda msg: None, **settings).run(until_empty=True)
        assert (summary.stop_reason, summary.handled) == ("empty", 0)
        if left := message_ids(engine, "t") & set(ids):
            kept.append((run, left))
    assert not kept, f"runs that returned with expired messages left: {kept}"


@pytest.mark.slow
def test_a_cron_run_that_drains_at_once_still_runs_its_retention_pass(
    engine: Engine, pgq_env: dict[str, str], tmp_path: Path
) -> None:
    """The same as `pgq consume --until-empty`: every run deletes the expired
    messages before it exits."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    env = consumer_env(pgq_env, tmp_path, **CLI_SETTINGS)
    kept: list[tuple[int, set[int]]] = []
    for run in range(CLI_RUNS):
        ids = pgq.publish_many(engine, "t", [{"run": run, "i": i} for i in range(20)])
        finish_and_expire(engine, "t", "g", ids)
        proc = spawn_pgq(env, "consume", "g", "--handler", "handlers:record", "--until-empty")
        code, _, err = finish(proc, 60)
        assert code == 0, err
        if left := message_ids(engine, "t") & set(ids):
            kept.append((run, left))
    assert not kept, f"runs that exited with expired messages left: {kept}"


def test_a_retention_pass_that_cannot_get_its_lock_is_skipped_not_waited_for(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """An open transaction holds the topic as a subscribe does: the run's retention
    passes (its start-up one, then the final pass's) give up on the lock after a
    few seconds, the run returns and says so; the next run deletes the messages."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(20)])
    finish_and_expire(engine, "t", "g", ids)
    settings: dict[str, Any] = {"workers": 2, "retention": 60.0, **FAST}
    with engine.connect() as holder:
        holder.execute(select(t.topic.c.id).where(t.topic.c.name == "t").with_for_update()).one()
        started = time.monotonic()
        summary = pgq.Consumer(engine, "g", lambda msg: None, **settings).run(until_empty=True)
        took = time.monotonic() - started
        holder.rollback()
    assert summary.stop_reason == "empty"
    assert took < HOUSEKEEPING_LOCK_TIMEOUT + EXPIRE_BUDGET + 5, took
    assert set(ids) <= message_ids(engine, "t")
    skipped = [r for r in caplog.records if r.getMessage().startswith("final retention skipped")]
    assert skipped and "reason=lock_timeout" in skipped[0].getMessage(), caplog.text
    pgq.Consumer(engine, "g", lambda msg: None, **settings).run(until_empty=True)
    assert not message_ids(engine, "t") & set(ids)
