"""What an outage charged is what its close refunds (DESIGN §5, §6.4–6.5; issue 10 #8).

Each test drives the group's own statements (claim, outcomes, sweep, close,
reconcile, probe claim) on the real database, moving only time by hand: a lease
is made to expire by writing its expiry into the past.
"""

from __future__ import annotations

import datetime as dt

from helpers import across_groups
from sqlalchemy import Engine, text

import pgq
from pgq import monitor
from pgq.records import Claimed, Outcome
from pgq.store import GroupStore, group_info, run_once

MAX_REFUNDS = 3


def store(engine: Engine, max_reclaims: int) -> GroupStore:
    info = group_info(engine, "billing")
    return GroupStore(info.id, "billing", "orders", "m", 30.0, max_reclaims)


def sql(engine: Engine, schema: str, statement: str, **params: object) -> None:
    """A test's own change, by hand, over every group's rows."""
    with across_groups(engine) as conn:
        conn.execute(text(statement.replace("{s}", f'"{schema}"')), params)


def row(engine: Engine, schema: str, mid: int):
    with across_groups(engine) as conn:
        return conn.execute(
            text(f'SELECT * FROM "{schema}".delivery WHERE message_id = :id'), {"id": mid}
        ).one()


def claim_one(engine: Engine, s: GroupStore, epoch: int) -> Claimed:
    [claimed] = run_once(engine, s.claim, 1, epoch)
    return claimed


def expire_and_sweep(engine: Engine, schema: str, s: GroupStore) -> None:
    sql(engine, schema, "UPDATE {s}.delivery SET lease_expires_at = now() - interval '1 second'")
    run_once(engine, s.sweep)


def set_breaker(engine: Engine, schema: str, state: str, epoch: int) -> None:
    sql(engine, schema, "UPDATE {s}.breaker SET state = :state, epoch = :epoch", state=state,
        epoch=epoch)  # fmt: skip


def close_and_reconcile(engine: Engine, s: GroupStore, open_epoch: int) -> int:
    """The prober's close of the outage at `open_epoch` and its whole reconciliation."""
    close = run_once(engine, s.close, open_epoch)
    assert close == open_epoch + 1
    view = run_once(engine, s.breaker)
    refunded = run_once(engine, s.reconcile_batch, close, view.reconcile_from, MAX_REFUNDS, 100)
    run_once(engine, s.reconcile_done, close, view.reconcile_from, MAX_REFUNDS)
    return refunded


def test_a_row_that_died_of_reclaims_during_the_outage_is_refunded_at_the_close(orders, schema):
    """Failed on fcf4473: the row stayed dead as `lease`, its outage reclaim kept."""
    engine = orders
    [mid] = pgq.publish_many(engine, "orders", [{"n": 1}])
    s = store(engine, max_reclaims=1)
    claim_one(engine, s, 0)
    expire_and_sweep(engine, schema, s)  # healthy: a reclaim that is the row's own
    claim_one(engine, s, 0)
    set_breaker(engine, schema, "OPEN", 1)  # the outage: the holder never answers
    expire_and_sweep(engine, schema, s)
    before = row(engine, schema, mid)
    assert (before.state, before.error_class, before.reclaims) == ("dead", "lease", 2)

    state, line = monitor.check(engine, "billing")
    assert state == "WARNING"
    assert line == "WARNING: breaker open, 1 dead rows pending reconciliation"

    assert close_and_reconcile(engine, s, 1) == 1
    after = row(engine, schema, mid)
    assert (after.state, after.reclaims, after.refundable_reclaims, after.refunds) == (
        "ready",
        1,  # the outage's reclaim refunded, the healthy one kept
        0,
        1,
    )
    assert after.error_class is None
    assert claim_one(engine, s, 2).id == mid


def test_a_row_reclaimed_during_the_outage_gets_its_reclaim_back(orders, schema):
    engine = orders
    [mid] = pgq.publish_many(engine, "orders", [{"n": 1}])
    s = store(engine, max_reclaims=3)
    claim_one(engine, s, 0)
    set_breaker(engine, schema, "OPEN", 1)
    expire_and_sweep(engine, schema, s)
    assert row(engine, schema, mid).reclaims == 1
    assert close_and_reconcile(engine, s, 1) == 1
    after = row(engine, schema, mid)
    assert (after.state, after.reclaims, after.refunds) == ("ready", 0, 1)


def test_a_row_that_died_of_its_own_reclaims_stays_dead_through_a_later_close(orders, schema):
    """A reclaim no breaker explains is the row's own: dying of it drops the charges a
    lone local trip left on the row, so the next group close does not bring it back."""
    engine = orders
    [mid] = pgq.publish_many(engine, "orders", [{"n": 1}])
    s = store(engine, max_reclaims=1)
    sql(engine, schema, "UPDATE {s}.delivery SET reclaims = 1, refundable_reclaims = 1")
    claim_one(engine, s, 0)
    expire_and_sweep(engine, schema, s)
    dead = row(engine, schema, mid)
    assert (dead.state, dead.error_class, dead.refundable_reclaims) == ("dead", "lease", 0)

    set_breaker(engine, schema, "OPEN", 1)
    assert close_and_reconcile(engine, s, 1) == 0
    assert row(engine, schema, mid).state == "dead"
    assert monitor.check(engine, "billing")[0] == "CRITICAL"


def test_a_row_snoozed_after_a_systemic_failure_keeps_its_time(orders, schema):
    """Failed on fcf4473: the probe took the snoozed row as a systemic retry (run an
    hour early), and the close made it ready at once."""
    engine = orders
    [mid] = pgq.publish_many(engine, "orders", [{"n": 1}])
    s = store(engine, max_reclaims=3)
    claimed = claim_one(engine, s, 0)
    failed = Outcome(claimed, "retry", 0.0, "systemic", "ConnectionError: down")
    assert run_once(engine, s.record, [failed]) == {claimed.lease}
    claimed = claim_one(engine, s, 0)
    snoozed = Outcome(claimed, "snooze", 3600.0)
    assert run_once(engine, s.record, [snoozed]) == {claimed.lease}
    wake = row(engine, schema, mid).available_at

    set_breaker(engine, schema, "OPEN", 1)
    sql(engine, schema, "UPDATE {s}.breaker SET next_probe_at = now()")
    assert run_once(engine, s.claim_probe, 1, MAX_REFUNDS, 5.0) is None

    assert close_and_reconcile(engine, s, 1) == 1
    after = row(engine, schema, mid)
    assert (after.state, after.attempts, after.refundable_attempts) == ("ready", 0, 0)
    assert after.available_at == wake
    assert after.available_at > after.updated_at + dt.timedelta(minutes=59)
    assert run_once(engine, s.claim, 10, 2) == []


def test_a_failure_after_the_close_is_not_refunded_by_that_close(orders, schema):
    """Found by the stateful breaker model; failed on 4d06b63: a member whose gate still
    believed in the epoch before a short outage claimed a row the reconciliation had
    refunded, it failed as systemic and was filed under the old epoch, inside the
    close's window: the same reconciliation refunded it a second time."""
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    info = group_info(engine, "billing")
    a, c = (GroupStore(info.id, "billing", "orders", name, 600.0, 3) for name in "ac")
    rows = run_once(engine, a.claim, 4, 0)
    run_once(engine, a.record, [Outcome(r, "retry", 0.0, "systemic", "down") for r in rows])
    set_breaker(engine, schema, "OPEN", 1)
    close = run_once(engine, a.close, 1)
    assert close == 2
    assert run_once(engine, a.reconcile_batch, close, 0, MAX_REFUNDS, 1) == 1
    [again] = run_once(engine, c.claim, 1, 0)  # c's gate has not heard of the outage
    assert again.epoch == 2  # filed under the epoch the claim saw, not c's
    failed = Outcome(again, "retry", 0.0, "systemic", "failed after the close")
    run_once(engine, c.record, [failed])
    while run_once(engine, a.reconcile_batch, close, 0, MAX_REFUNDS, 1):
        pass
    assert run_once(engine, a.reconcile_done, close, 0, MAX_REFUNDS)
    after = row(engine, schema, again.id)
    assert (after.refunds, after.refundable_attempts, after.error_epoch) == (1, 1, 2)
