"""Members refresh the delivery table's planner statistics after a burst."""

from __future__ import annotations

import logging

from helpers import wait_until
from sqlalchemy import Engine, text

import pgq
from pgq.store import GroupStore, group_info, run_once


def test_a_burst_gets_the_delivery_table_analyzed_once(engine: Engine, schema: str, caplog):
    caplog.set_level(logging.DEBUG, logger="pgq.store")
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    with engine.begin() as conn:
        pgq.publish_many(conn, "t", [{"i": i} for i in range(5000)])
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
    store = GroupStore(group_info(engine, "g").id, "g", "t", "m", 30, 3)
    wait_until(lambda: run_once(engine, store.refresh_statistics), 20, "an ANALYZE")
    with engine.connect() as conn:
        analyzed = conn.execute(
            text(
                "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables"
                " WHERE relid = to_regclass(:rel)"
            ),
            {"rel": f'"{schema}".delivery'},
        ).scalar()
    assert analyzed
    assert not run_once(engine, store.refresh_statistics)  # fresh now: nothing to do
    # routine (every ~30 s per member under load): a debug line, not INFO noise
    [analyzed_line] = [r for r in caplog.records if r.getMessage().startswith("analyzed delivery")]
    assert analyzed_line.levelno == logging.DEBUG
