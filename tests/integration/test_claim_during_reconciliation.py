"""While a close still owes a reconciliation, claims skip the rows it owes a refund
(DESIGN §6.5; issue 10 #2): they run only once refunded, at their refunded attempt."""

from __future__ import annotations

from sqlalchemy import text

import pgq
from pgq.store import GroupStore, group_info, run_once


def test_claims_skip_rows_owed_a_refund_until_the_reconciliation_is_done(orders, schema):
    engine = orders
    owed, fresh, old = pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    with engine.begin() as conn:
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
    run_once(engine, store.reconcile_done, 3)
    [row] = run_once(engine, store.claim, 10, 3)
    assert (row.id, row.message.attempt) == (owed, 1)
