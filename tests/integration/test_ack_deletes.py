"""The ack deletes what it finishes (schema version 6, decision 0037).

A batch of successes leaves one row: the batch's last in (xid, id) order, marked
done, for the frontier to land on; the others go at once and are counted into the
group's `done_pruned`. The group's done count stays whole through the prune and
through forgetting the member, `pgq show` still says done, and a success whose
answer a cut connection lost is recognised by its row being gone.
"""

from __future__ import annotations

import pytest
from helpers import rows, wait_for_frontier
from sqlalchemy import Engine, select, text

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.records import Outcome
from pgq.store import GroupStore, group_info, run_once
from pgq.store.members import forget_departed


def store_of(engine: Engine, member: str = "m") -> GroupStore:
    store = GroupStore(group_info(engine, "billing").id, "billing", "orders", member, 30.0, 3)
    run_once(engine, store.join, 30.0, True)
    return store


def done_pruned(engine: Engine) -> int:
    gs = t.group_state
    gid = group_info(engine, "billing").id
    with engine.connect() as conn:
        return int(conn.scalar(select(gs.c.done_pruned).where(gs.c.group_id == gid)))


def test_a_batch_leaves_its_last_row_done_and_counts_the_rest_for_the_group(orders):
    engine = orders
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(8)])
    store = store_of(engine)
    claimed = run_once(engine, store.claim, 8, 0)
    assert sorted(c.id for c in claimed) == ids
    applied = run_once(engine, store.record, [Outcome(c, "done") for c in claimed])
    assert applied == {c.lease for c in claimed}
    left = rows(engine, "billing")
    # one transaction published them: the last in (xid, id) order is the last id
    assert list(left) == [ids[-1]]
    assert (left[ids[-1]].state, left[ids[-1]].attempts) == ("done", 1)
    assert left[ids[-1]].lease_owner is None
    assert done_pruned(engine) == 7
    assert pgq.status(engine, "billing")["counts"]["done"] == 8


def test_the_done_count_is_whole_through_the_prune_and_forgetting_the_member(orders):
    engine = orders
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(30)])
    summary = pgq.Consumer(engine, "billing", lambda m: None, workers=2).run(until_empty=True)
    assert summary.done == 30
    wait_for_frontier(engine, "billing", ids[-1], advance=True)
    status = pgq.status(engine, "billing")
    assert (status["committed"], status["counts"]["done"], status["lag"]) == (ids[-1], 30, 0)
    assert rows(engine, "billing") == {}  # the last row, pruned behind the frontier
    gid = group_info(engine, "billing").id
    with engine.begin() as conn:
        assert len(forget_departed(conn, gid, 0.0)) == 1  # the run's member, gone
    assert pgq.status(engine, "billing")["counts"]["done"] == 30


def test_show_says_done_for_a_message_whose_row_its_ack_deleted(orders):
    engine = orders
    pin = pgq.publish(engine, "orders", {"pin": True}, delay=3600)  # holds the frontier
    ids = pgq.publish_many(engine, "orders", [{"n": 1}, {"n": 2}])
    store = store_of(engine)
    claimed = run_once(engine, store.claim, 5, 0)
    run_once(engine, store.record, [Outcome(c, "done") for c in claimed])
    assert ids[0] not in rows(engine, "billing")
    shown = monitor.message(engine, "billing", ids[0])
    assert (shown["state"], shown["row"], shown["behind_frontier"]) == ("done", "pruned", False)
    assert monitor.message(engine, "billing", pin)["state"] == "ready"


def test_a_success_whose_row_is_gone_is_settled_and_a_failure_is_not(orders):
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}])
    store = store_of(engine)
    first, second, third, _ = sorted(run_once(engine, store.claim, 4, 0), key=lambda c: c.id)
    run_once(engine, store.record, [Outcome(first, "done"), Outcome(second, "done")])
    assert first.id not in rows(engine, "billing")
    retry = Outcome(first, "retry", delay=0.0, error_class="message", error="x")
    still_leased = Outcome(third, "done")
    found = run_once(engine, store.settled, [Outcome(first, "done"), retry, still_leased])
    assert found == {first.lease}


def test_a_group_records_where_it_started_and_show_tells_what_it_never_had(orders):
    """`latest`: a message published before the subscribe was never the group's, even
    with no row and no frontier past it; `earliest` (the default): the same message,
    its row gone, was finished."""
    engine = orders
    before = pgq.publish(engine, "orders", {"n": 0})
    pgq.subscribe(engine, "late", "orders", start="latest")
    pgq.subscribe(engine, "backfilled", "orders")
    g = t.consumer_group
    with engine.connect() as conn:
        starts = {r.name: r.start for r in conn.execute(select(g.c.name, g.c.start))}
    assert (starts["late"], starts["backfilled"]) == ("latest", "earliest")
    with pytest.raises(pgq.UsageError, match="has no message"):
        monitor.message(engine, "late", before)
    store = GroupStore(group_info(engine, "backfilled").id, "backfilled", "orders", "m", 30.0, 3)
    run_once(engine, store.join, 30.0, True)
    pgq.publish(engine, "orders", {"pin": True}, delay=3600)  # holds the frontier
    after = pgq.publish(engine, "orders", {"n": 2})
    claimed = run_once(engine, store.claim, 2, 0)
    assert sorted(c.id for c in claimed) == [before, after]
    run_once(engine, store.record, [Outcome(c, "done") for c in claimed])
    assert before not in rows(engine, "backfilled")  # the batch kept `after`
    shown = monitor.message(engine, "backfilled", before)
    assert (shown["state"], shown["behind_frontier"]) == ("done", False)


def test_an_ack_that_deletes_nothing_leaves_the_groups_row_alone(orders):
    """A batch of one (a low rate) keeps its only row for the frontier: the ack
    writes no new version of `group_state` and takes no lock on it."""
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": 1}, {"n": 2}])
    store = store_of(engine)
    gid = group_info(engine, "billing").id

    def version() -> str:
        with engine.connect() as conn:
            xmin = select(t.group_state.c.group_id.label("g"), text("xmin::text"))
            return conn.execute(xmin.where(t.group_state.c.group_id == gid)).one()[1]

    before = version()
    (one,) = run_once(engine, store.claim, 1, 0)
    assert run_once(engine, store.record, [Outcome(one, "done")]) == {one.lease}
    assert (version(), done_pruned(engine)) == (before, 0)
    (two,) = run_once(engine, store.claim, 1, 0)
    assert run_once(engine, store.record, [Outcome(two, "done")]) == {two.lease}
    assert pgq.status(engine, "billing")["counts"]["done"] == 2
