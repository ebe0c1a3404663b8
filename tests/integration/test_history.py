"""A message's history in a group (`attempt`, schema version 9; decision 0046).

The group's own statements (claim, outcomes, sweep, close, reconcile) run on the
real database and write the lines; `pgq.store.history.message_history` reads
them back as the dashboard's message page shows them. Time is moved by hand: a
lease expires by writing its expiry into the past. Those hand-made changes and the
counts for the asserts run over every row (`helpers.across_groups`: on Citus, on
every shard).
"""

from __future__ import annotations

import datetime as dt
import threading
import urllib.request

import pytest
from helpers import across_groups
from sqlalchemy import Engine, func, select, text, update

import pgq
from pgq import schema as t
from pgq.read_models import MessageHistory
from pgq.records import AttemptEvent, Claimed, Outcome, OutcomeKind
from pgq.store import GroupStore, group_info, run_once
from pgq.store.history import message_history

MAX_REFUNDS = 3
FAR_PAST = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)


def store(engine: Engine, max_reclaims: int = 3, member: str = "m") -> GroupStore:
    info = group_info(engine, "billing")
    return GroupStore(info.id, "billing", "orders", member, 30.0, max_reclaims)


def history(engine: Engine, mid: int) -> MessageHistory:
    return message_history(engine, "billing", mid, FAR_PAST)


def claim(engine: Engine, s: GroupStore, epoch: int = 0) -> Claimed:
    [claimed] = run_once(engine, s.claim, 1, epoch)
    return claimed


def fail(engine: Engine, s: GroupStore, claimed: Claimed, kind: str, cls: str | None, **kw) -> None:
    outcome = Outcome(claimed, OutcomeKind(kind), 0.0, cls, f"{cls} failure", **kw)
    assert run_once(engine, s.record, [outcome]) == {claimed.lease}


def set_breaker(engine: Engine, state: str, epoch: int) -> None:
    with across_groups(engine) as conn:
        conn.execute(update(t.breaker).values(state=state, epoch=epoch))


def expire_and_sweep(engine: Engine, s: GroupStore) -> None:
    with across_groups(engine) as conn:
        conn.execute(update(t.delivery).values(lease_expires_at=func.now() - text("interval '1s'")))
    run_once(engine, s.sweep)


def test_failures_write_lines_a_success_writes_none(orders):
    """Each failed attempt is a line: who ran it, how long, its class and error, the
    epoch, the row's counters after it; the last one `died`. A success adds none."""
    [mid, other] = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])
    s = store(orders)
    first = claim(orders, s)
    assert first.id == mid
    fail(orders, s, first, "retry", "message", seconds=0.25)
    with across_groups(orders) as conn:  # due now: the retry's backoff moved by hand
        conn.execute(update(t.delivery).values(available_at=func.now()))
    fail(orders, s, claim(orders, s), "dead", "permanent")
    done = claim(orders, s)
    assert done.id == other
    assert run_once(orders, s.record, [Outcome(done, OutcomeKind.DONE)]) == {done.lease}

    found = history(orders, mid)
    assert [(x.n, x.event, x.member, x.error_class) for x in found.lines] == [
        (1, AttemptEvent.FAILED, "m", "message"),
        (2, AttemptEvent.DIED, "m", "permanent"),
    ]
    assert found.lines[0].seconds == 0.25 and found.lines[1].seconds is None
    assert [(x.attempts, x.reclaims, x.refunds) for x in found.lines] == [(1, 0, 0), (2, 0, 0)]
    assert found.lines[0].error == "message failure"
    assert found.lines_written == 2 and found.lines_lost == 0
    assert history(orders, other).lines == ()


def test_a_snooze_is_a_line_without_a_charge(orders):
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    fail(orders, s, claim(orders, s), "snooze", None)
    [line] = history(orders, mid).lines
    assert (line.event, line.attempts, line.error_class) == (AttemptEvent.SNOOZED, 0, None)


def test_an_expired_lease_is_a_line_naming_its_holder_and_dying_of_it_too(orders):
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders, max_reclaims=1, member="lost")
    claim(orders, s)
    expire_and_sweep(orders, s)
    claim(orders, s)
    expire_and_sweep(orders, s)
    lines = history(orders, mid).lines
    assert [(x.event, x.member, x.reclaims) for x in lines] == [
        (AttemptEvent.RECLAIMED, "lost", 1),
        (AttemptEvent.DIED, "lost", 2),
    ]
    assert lines[1].error_class == "lease" and lines[0].error_class is None


def test_an_outage_and_its_refund_in_the_history_with_the_breaker_s_epochs(orders):
    """Systemic failures under the open breaker, then the close's refund: the lines
    say so in order, with the epochs; the breaker's transitions are there too."""
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    claimed = claim(orders, s)  # the attempt starts, and the dependency goes down
    set_breaker(orders, "OPEN", 1)
    with orders.begin() as conn:
        conn.execute(
            t.breaker_history.insert().values(group_id=s.gid, epoch=1, state="OPEN", by_member="m")
        )
    fail(orders, s, claimed, "dead", "systemic")
    close = run_once(orders, s.close, 1)
    view = run_once(orders, s.breaker)
    assert run_once(orders, s.reconcile_batch, close, view.reconcile_from, MAX_REFUNDS, 100) == 1

    found = history(orders, mid)
    assert [(x.event, x.epoch, x.attempts, x.refunds) for x in found.lines] == [
        (AttemptEvent.DIED, 0, 1, 0),  # the epoch it ran under
        (AttemptEvent.REFUNDED, close, 0, 1),
    ]
    assert found.lines[1].member == "m"
    assert [(tr.epoch, tr.state.value) for tr in found.breaker] == [(1, "OPEN"), (2, "CLOSED")]


def test_the_history_keeps_the_newest_lines_in_a_ring(orders):
    """A message that fails for ever keeps `HISTORY_SLOTS` lines, the newest."""
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    total = t.HISTORY_SLOTS + 5
    for _ in range(total):
        fail(orders, s, claim(orders, s), "snooze", None)
    found = history(orders, mid)
    assert [x.n for x in found.lines] == list(range(6, total + 1))
    assert (found.lines_written, found.lines_lost) == (total, 5)
    with across_groups(orders) as conn:
        kept = conn.execute(select(func.count()).select_from(t.attempt)).scalar_one()
    assert kept == t.HISTORY_SLOTS


def test_retention_deletes_old_lines_and_unsubscribe_the_group_s(orders):
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    fail(orders, s, claim(orders, s), "snooze", None)
    fail(orders, s, claim(orders, s), "snooze", None)
    with across_groups(orders) as conn:
        conn.execute(
            update(t.attempt)
            .where(t.attempt.c.n == 1)
            .values(at=func.now() - text("interval '2 days'"))
        )
    assert run_once(orders, s.expire_history, 86400.0) == 1
    assert [x.n for x in history(orders, mid).lines] == [2]
    pgq.unsubscribe(orders, "billing", reason="test")
    with across_groups(orders) as conn:
        assert conn.execute(select(func.count()).select_from(t.attempt)).scalar_one() == 0


def test_a_successful_probe_s_refund_is_a_refunded_line(orders):
    """The probe that closes an outage refunds the systemic charges of the row it ran
    (its close counts it among the `refunded`): that refund is a line, like the
    close's reconciliation of the other rows, with the counters after it. Failed
    until `probe_done` wrote one: the page showed the charges, then `done`, and the
    close's "refunded 1" had no line anywhere."""
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    claimed = claim(orders, s)
    set_breaker(orders, "OPEN", 1)
    fail(orders, s, claimed, "retry", "systemic")
    with across_groups(orders) as conn:  # the retry's backoff moved by hand
        conn.execute(update(t.delivery).values(available_at=func.now()))
    probe = run_once(orders, s.claim_probe, 1, MAX_REFUNDS, 30.0)
    assert probe is not None and probe.id == mid
    written, close = run_once(orders, s.probe_succeeded, probe, 1)
    assert written and close is not None

    found = history(orders, mid)
    assert [(x.event, x.member, x.epoch, x.attempts, x.refunds) for x in found.lines] == [
        (AttemptEvent.FAILED, "m", 0, 1, 0),
        (AttemptEvent.REFUNDED, "m", close, 1, 1),  # the probe's own attempt, done
    ]
    with across_groups(orders) as conn:
        events = conn.execute(select(t.delivery.c.events)).scalar_one()
    assert events == 2


def test_a_probe_without_charges_writes_no_line(orders):
    """A probe that succeeds on a row with nothing to refund is a success: no line."""
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    set_breaker(orders, "OPEN", 1)
    probe = run_once(orders, s.claim_probe, 1, MAX_REFUNDS, 30.0)
    assert probe is not None and probe.id == mid
    written, _close = run_once(orders, s.probe_succeeded, probe, 1)
    assert written
    assert history(orders, mid).lines == ()


def test_a_held_row_whose_lines_retention_took_says_they_are_gone(orders):
    """Retention takes lines older than it even where the row is still held (a dead
    row waits for an operator past retention): the history then counts the row's
    lines (`delivery.events`), not the newest kept, and the page says they are
    gone. Failed before: `lines_written` was 0 and the page said the message had
    no failure recorded, for a row dead of its failures."""
    [mid] = pgq.publish_many(orders, "orders", [{"n": 1}])
    s = store(orders)
    fail(orders, s, claim(orders, s), "dead", "permanent")
    with across_groups(orders) as conn:
        conn.execute(update(t.attempt).values(at=func.now() - text("interval '2 days'")))
    assert run_once(orders, s.expire_history, 86400.0) == 1
    found = history(orders, mid)
    assert (found.lines, found.lines_written, found.lines_lost) == ((), 1, 1)

    pytest.importorskip("flask")
    from pgq.web import dashboard_server

    server = dashboard_server(orders, host="127.0.0.1", port=0)
    server.start()
    try:
        with urllib.request.urlopen(f"{server.url}groups/billing/messages/{mid}") as answer:
            page = answer.read().decode()
    finally:
        server.close()
    assert "the 1 oldest line of 1 no longer kept" in page
    assert 'id="no-history"' not in page


def test_two_members_failing_often_write_one_line_per_failure_in_order(orders):
    """Two real members share the group; the handler fails by the message's id (a
    permanent error, message errors then a success, a snooze then a success, message
    errors until it dies, a success). After the drain each message's lines are
    n = 1..k, one per failed call the handlers saw, in their order, with the
    counters the calls imply; a success writes none."""
    from pgq.errors import PermanentError, RetryLater

    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(40)])
    calls: dict[int, list[str]] = {mid: [] for mid in ids}
    lock = threading.Lock()

    def handle(msg: pgq.Message) -> None:
        with lock:
            seen = calls[msg.id]
            kind = msg.id % 5
            if kind == 0:
                outcome = "died"
            elif kind == 1:
                outcome = "failed" if msg.attempt <= 2 else "done"
            elif kind == 2:
                outcome = "snoozed" if not seen else "done"
            elif kind == 3:
                outcome = "died" if msg.attempt == 3 else "failed"
            else:
                outcome = "done"
            seen.append(outcome)
        if outcome == "died" and kind == 0:
            raise PermanentError("poison")
        if outcome in ("failed", "died"):
            raise ValueError(f"failed {msg.id} at {msg.attempt}")
        if outcome == "snoozed":
            raise RetryLater(0.0)

    settings = {"retry_backoff": 0.01, "poll_interval": 0.05, "max_attempts": 3, "workers": 2}
    members = [pgq.Consumer(orders, "billing", handle, name=f"m{i}", **settings) for i in (1, 2)]
    threads = [
        threading.Thread(target=m.run, kwargs={"until_empty": True, "wait_retries": 5.0})
        for m in members
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)

    for mid in ids:
        expected, attempts = [], 0
        for outcome in calls[mid]:
            if outcome == "done":
                continue
            attempts += outcome != "snoozed"
            expected.append((len(expected) + 1, outcome, attempts, 0, 0))
        lines = history(orders, mid).lines
        got = [(x.n, x.event, x.attempts, x.reclaims, x.refunds) for x in lines]
        assert got == expected, (mid, calls[mid])
        for x in lines:
            assert x.member in ("m1", "m2")
            assert (x.seconds is not None) and x.seconds >= 0
            assert (x.error_class is None) == (x.event == AttemptEvent.SNOOZED)
    assert sorted({tuple(c) for c in calls.values()}) == sorted(
        {
            ("died",),
            ("failed", "failed", "done"),
            ("snoozed", "done"),
            ("failed", "failed", "died"),
            ("done",),
        }
    )
