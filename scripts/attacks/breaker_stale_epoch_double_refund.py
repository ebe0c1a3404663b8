"""A row is refunded twice for one close when a member whose gate has not heard of the
outage claims it during the reconciliation and it fails as systemic.

Found by the stateful breaker model (tests/integration/test_stateful_breaker.py),
shrunk by hand to the store calls the consumer's threads make.

What it shows: an attempt's `error_epoch` is the epoch the *claiming member's gate*
knows (`GroupStore.claim(conn, limit, gate.epoch)`), not the epoch the database was
at when the row was claimed. A member's gate learns the group state from its
heartbeat (every `breaker.heartbeat`, 2 s by default); an outage that opens and
closes between two of its heartbeats (the first probe runs at once on the open,
so a short blip closes within a second) leaves it at the epoch before the open.
While the close's reconciliation is still owed, that member claims a row the
reconciliation already refunded (claims skip only the rows still owed), the
attempt fails as systemic, and the failure is filed under the old epoch: inside
the close's window [previous close, close). The next batch of the same
reconciliation refunds the row again: two refunds for one close, and a failure
that happened after the close (the dependency back) is refunded by it (its
attempt charge disappears) instead of waiting for a later outage's close.

Expected (issue 10; DESIGN §6.5: "no row is refunded twice for one close"): the
row keeps the charge of its post-close failure; `refunds` = 1 for this close.
Actual: `refunds` = 2, the close's history counts the row twice.

Run: .venv/bin/python scripts/attacks/breaker_stale_epoch_double_refund.py (~1 s)
Exit 0 once fixed, 1 while the defect exists. Severity: minor (a refund the design
does not allow; bounded by breaker.max_refunds). Exit 1 on 4d06b63; fixed in
71e98eb: the claim returns the epoch it saw and the attempt is filed under the
later of that and the gate's.
"""

from _common import Schema, verdict
from sqlalchemy import select

import pgq
from pgq import schema as t
from pgq.records import Outcome
from pgq.store import GroupStore, group_info, member_lock

with Schema("stale_epoch") as s:
    engine = s.engine
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    gid = group_info(engine, "g").id
    pgq.publish_many(engine, "t", [{"n": i} for i in range(3)])
    locks, stores = [], {}
    for name in "ABC":  # three live members: a session lock and a heartbeat each
        lock = member_lock(engine, gid, name)
        assert lock.acquire()
        locks.append(lock)
        store = GroupStore(gid, "g", "t", name, 600.0, 3)
        with engine.begin() as conn:
            assert store.join(conn, 600.0, True)
            store.heartbeat(conn, "closed", None)
        stores[name] = store
    A, C = stores["A"], stores["C"]

    def run(fn, *args, **kwargs):
        with engine.begin() as conn:
            return fn(conn, *args, **kwargs)

    try:
        # the outage at epoch 0: the three rows fail as systemic under A
        rows = run(A.claim, 4, 0)
        run(A.record, [Outcome(r, "retry", 0.0, "systemic", "down") for r in rows])
        # A and B trip, the quorum opens the group (epoch 1); C heartbeats no more meanwhile
        run(A.heartbeat, "open", 0)
        run(stores["B"].heartbeat, "open", 0)
        assert run(A.open_on_quorum, 0, ttl=600, min_members=2, quorum=0.5) == 1
        # the dependency is back: A's first probe succeeds and closes (epoch 2)
        probe = run(A.claim_probe, 1, 3, 601.0, 600.0)
        assert run(A.probe_succeeded, probe, 1) == (True, 2)
        # the reconciliation owes [0, 2); its first batch refunds one row
        assert run(A.reconcile_batch, 2, 0, 3, 1) == 1
        # C, whose gate still says CLOSED at epoch 0, claims that row; it fails systemic
        [again] = run(C.claim, 1, 0)
        run(C.record, [Outcome(again, "retry", 0.0, "systemic", "failed after the close")])
        while run(A.reconcile_batch, 2, 0, 3, 1):
            pass
        assert run(A.reconcile_done, 2, 0, 3)
        with engine.connect() as conn:
            refunds = conn.execute(
                select(t.delivery.c.refunds).where(
                    t.delivery.c.group_id == gid, t.delivery.c.message_id == again.id
                )
            ).scalar_one()
            refunded = conn.execute(
                select(t.breaker_history.c.refunded).where(
                    t.breaker_history.c.group_id == gid, t.breaker_history.c.epoch == 2
                )
            ).scalar_one()
    finally:
        for lock in locks:
            lock.release()
    problems = []
    if refunds != 1:
        problems.append(
            f"row {again.id} refunded {refunds} times for the close at epoch 2 (3 rows,"
            f" the close's history counts {refunded} refunds)"
        )
    verdict(problems, "a row is refunded at most once per close")
