"""Attack on `settled` (decision 0039), which tells an outcome whose write's answer a
cut lost from a reclaim, for the acker and now for the prober.

Found by attack: the branch added for a probe's systemic failure on a row that
stays dead ("attempts not charged, class systemic") tests neither the kind nor the
state it was meant for. An expiry sweep leaves a row that does not die as it
was, but ready, uncharged and with its error class: so for a row whose last
failure was systemic (every row of an outage), a systemic failure whose write
never committed, and whose lease another member's sweep then ended, reads as
written. The member counts it retried, not refused ("lease lost"), and a probe's
takes the same path.
"""

from __future__ import annotations

from helpers import pin_frontier, rows
from sqlalchemy import Engine, text

import pgq
from pgq.records import Claimed, Outcome, OutcomeKind
from pgq.store import GroupStore, group_info, run_once


def test_a_systemic_failure_the_sweep_reclaimed_is_not_settled(orders: Engine, schema: str) -> None:
    engine = orders
    pin_frontier(engine, "orders")
    mid = pgq.publish(engine, "orders", {"n": 1})
    store = GroupStore(group_info(engine, "billing").id, "billing", "orders", "m", 30.0, 3)

    def systemic(claimed: Claimed) -> Outcome:
        return Outcome(claimed, OutcomeKind.RETRY, 0.0, "systemic", "the dependency is down")

    [first] = run_once(engine, store.claim, 1, 0)
    assert run_once(engine, store.record, [systemic(first)]) == {first.lease}
    [second] = run_once(engine, store.claim, 1, 0)  # its outcome's write will never commit
    with engine.begin() as conn:  # its lease runs out: another member's sweep reclaims it
        conn.execute(
            text(f"UPDATE \"{schema}\".delivery SET lease_expires_at = now() - interval '1 s'")
        )
    assert run_once(engine, store.sweep).reclaimed == 1
    row = rows(engine, "billing")[mid]
    assert (row.state, row.lease_seq, row.attempts, row.reclaims) == ("ready", second.seq, 1, 1)

    # the write's retry found the lease gone: was it the write, or the sweep?
    assert run_once(engine, store.settled, [systemic(second)]) == set()
