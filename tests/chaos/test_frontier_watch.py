"""Self-tests of the frontier watch: it passes a frontier that waits for unresolved
rows, and catches one that passed a ready row or moved back, when we fake them."""

from __future__ import annotations

from pathlib import Path

from helpers import wait_until
from sqlalchemy import Engine, text, update

import pgq
from pgq import schema as t
from pgq.store.engine import schema_of

from . import history
from .frontier import FrontierWatch, frontier_table


def set_frontier(engine: Engine, group: str, message_id: int) -> None:
    """Put `group`'s position at `message_id`'s row, whatever its state (a fake)."""
    schema = schema_of(engine)
    table, key = frontier_table(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                f'UPDATE "{schema}".{table} f'
                " SET committed_xid = d.xid, committed_id = d.message_id,"
                " xid_space ="
                " (pg_catalog.pg_control_system()).system_identifier # f.tableoid::bigint"
                f' FROM "{schema}".delivery d, "{schema}".consumer_group g'
                f" WHERE g.name = :group AND f.{key} = g.id AND d.group_id = g.id"
                " AND d.message_id = :mid"
            ),
            {"group": group, "mid": message_id},
        )


def sample(watch: FrontierWatch, engine: Engine) -> None:
    statement, gids = watch._statement()
    with engine.begin() as conn:
        for group, gid in gids.items():
            watch.sample(conn, statement, group, gid)


def test_the_watch_catches_a_frontier_past_a_ready_row_and_one_moving_back(
    engine: Engine, out: Path
) -> None:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(5)])
    watch = FrontierWatch(engine, ["billing"])
    sample(watch, engine)  # no frontier yet: nothing to say
    assert (watch.samples, watch.violations, watch.moved_back) == (1, [], [])

    set_frontier(engine, "billing", ids[3])  # past four ready rows
    sample(watch, engine)
    [violation] = watch.violations
    assert violation.startswith("billing: frontier") and f"'{ids[0]} ready" in violation

    set_frontier(engine, "billing", ids[1])
    sample(watch, engine)
    assert len(watch.moved_back) == 1 and watch.moved_back[0].startswith("billing: frontier moved")

    summary = history.check(engine, "orders", out, published=ids, settled=False, frontier=watch)
    assert not summary.ok and len(summary.frontier) == 3, summary


def test_the_watch_takes_a_new_xid_space_for_a_new_start_and_skips_another_servers(
    engine: Engine,
) -> None:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    d = t.delivery
    with engine.begin() as conn:
        conn.execute(update(d).values(state="done"))
    watch = FrontierWatch(engine, ["billing"])
    set_frontier(engine, "billing", ids[2])
    sample(watch, engine)
    with engine.begin() as conn:  # as a shard move leaves it: another server's position
        conn.execute(update(t.group_state).values(xid_space=42))
        conn.execute(update(d).where(d.c.message_id == ids[0]).values(state="ready"))
    sample(watch, engine)  # promises nothing: not a violation
    with engine.begin() as conn:
        conn.execute(update(d).where(d.c.message_id == ids[0]).values(state="done"))
    set_frontier(engine, "billing", ids[0])  # started again here: not a move back
    sample(watch, engine)
    assert (watch.violations, watch.moved_back, watch.rebased) == ([], [], {"billing": 1})


def test_the_watch_thread_samples_every_group_and_stops(engine: Engine) -> None:
    pgq.create_topic(engine, "orders")
    for group in ("billing", "audit"):
        pgq.subscribe(engine, group, "orders")
    with FrontierWatch(engine, ["billing", "audit", "nosuch"], interval=0.01) as watch:
        pgq.publish_many(engine, "orders", [{"n": i} for i in range(5)])
        wait_until(lambda: watch.samples >= 4, 10, "four samples")
    assert watch.errors == ["groups not found: ['nosuch']"]
    assert watch.samples >= 4 and watch.violations == [] and watch.moved_back == []
