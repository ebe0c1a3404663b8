"""While a close still owes a reconciliation, claims skip the rows it owes a refund
(DESIGN §6.5; issue 10 #2): they run only once refunded, at their refunded attempt."""

from __future__ import annotations

from helpers import FAST, across_groups
from sqlalchemy import text

import pgq
from pgq.store import GroupStore, group_info, run_once


def test_claims_skip_rows_owed_a_refund_until_the_reconciliation_is_done(orders, schema):
    engine = orders
    owed, fresh, old = pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    with across_groups(engine) as conn:  # every group's rows, by hand
        conn.execute(text(f"UPDATE \"{schema}\".breaker SET epoch = 2, state = 'OPEN'"))
        conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET error_class = 'systemic', attempts = 4,"
                " refundable_attempts = 4, error_epoch = CASE message_id WHEN :owed THEN 2"
                " ELSE 0 END WHERE message_id IN (:owed, :old)"
            ),
            {"owed": owed, "old": old},
        )
    info = group_info(engine, "billing")
    store = GroupStore(info.id, "billing", "orders", "m", 30.0, 3)
    # the prober's close: epoch 3, refunds owed for the failures of epochs 1 and 2
    assert run_once(engine, store.close, 2) == 3
    claimed = run_once(engine, store.claim, 10, 3)
    assert sorted(row.id for row in claimed) == sorted([fresh, old])

    assert run_once(engine, store.reconcile_batch, 3, 1, 3, 100) == 1
    assert run_once(engine, store.reconcile_done, 3, 1, 3)
    [row] = run_once(engine, store.claim, 10, 3)
    assert (row.id, row.message.attempt) == (owed, 1)


def _dead_systemic(engine, schema: str, n: int, *, open_group: bool) -> list[int]:
    """`n` messages that died of an outage at epoch 1; the group OPEN at epoch 2."""
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(n)])
    with across_groups(engine) as conn:  # every group's rows, by hand
        conn.execute(text(f"UPDATE \"{schema}\".breaker SET epoch = 2, state = 'OPEN'"))
        conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'dead', error_class = 'systemic',"
                " error_epoch = 1, attempts = 5, refundable_attempts = 5, last_error = 'down'"
            )
        )
    if not open_group:  # a prober closed it and died before refunding anything
        info = group_info(engine, "billing")
        assert run_once(engine, GroupStore(info.id, "billing", "orders", "p", 30.0, 3).close, 2)
    return ids


def test_a_cron_run_finishes_a_reconciliation_a_dead_prober_left_owed(orders, schema):
    """Issue 10 #5: CLOSED with a reconciliation owed, `--until-empty` used to exit
    "empty" at once with every row still dead."""
    ids = _dead_systemic(orders, schema, 12, open_group=False)
    summary = pgq.Consumer(orders, "billing", lambda m: None, **FAST).run(
        until_empty=True, max_runtime=60
    )
    assert (summary.stop_reason, summary.done) == ("empty", len(ids))
    assert pgq.status(orders, "billing")["totals"]["refunded"] == len(ids)


def test_a_cron_run_that_closes_the_group_refunds_every_batch_before_it_counts_empty(
    orders, schema
):
    """Issue 10 #5: the run that probed and closed the group used to stop after the
    first 5,000-row refund batch, leaving the rest dead."""
    ids = _dead_systemic(orders, schema, 6000, open_group=True)
    summary = pgq.Consumer(orders, "billing", lambda m: None, **FAST).run(
        until_empty=True, max_runtime=120
    )
    assert summary.stop_reason == "empty"
    status = pgq.status(orders, "billing")
    assert (status["breaker"]["state"], status["counts"]["dead"]) == ("CLOSED", 0)
    assert status["counts"]["done"] == len(ids)
