"""Attacks on ordered groups (decision 0044): what broke the one-message-per-key rule
or left a key stuck, each pinned by the test that found it, and the paths around the
rule (a batch publish, a backlog subscribed `earliest`, requeue and purge of dead
rows, the transactional consumer, an outage with refunds) checked end to end."""

from __future__ import annotations

import threading

import pytest
from helpers import set_rows, wait_until
from sqlalchemy import BigInteger, Engine, Text, cast, func, literal_column, select, text, update
from test_ordered import claim, publish, store_of

import pgq
from pgq import schema as t
from pgq.store import requeue as requeue_rows

d, br = t.delivery, t.breaker


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    return ()


@pytest.fixture
def ordered(orders: Engine) -> Engine:
    """Topic `orders` with ordered group `g` and unordered group `u`."""
    pgq.subscribe(orders, "g", "orders", ordered=True)
    pgq.subscribe(orders, "u", "orders")
    return orders


def settled(engine: Engine, ids: list[int]) -> None:
    """Wait until every transaction that could publish before `ids` has ended (the
    server's xmin is past their xid): other sessions' transactions on a shared server
    hold keyed messages back for as long as they are open."""
    m = t.message
    xmin = text("pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
    newest = select(func.max(cast(m.c.xid, Text).cast(BigInteger))).where(m.c.id.in_(ids))

    def behind() -> bool:
        with engine.connect() as conn:
            return bool(conn.scalar(select(newest.scalar_subquery() < literal_column(xmin.text))))

    wait_until(behind, 30.0, "the publishes to fall behind the xmin")


def open_breaker(engine: Engine, gid: int, epoch: int = 1) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(br)
            .where(br.c.group_id == gid)
            .values(state="OPEN", epoch=epoch, next_probe_at=text("now()"))
        )


def test_a_dead_row_past_its_refunds_does_not_hold_an_outage_open(ordered: Engine):
    """A dead row the outage charged but refunded `max_refunds` times already is owed no
    refund: no close brings it back, so it must not hold its key. It did while the
    breaker was OPEN: the later message of its key was no probe (its key held) and the
    dead row no probe either (past the refund cap), yet the later message counted as a
    candidate, so the outage could not close idle: OPEN for good."""
    a1, a2 = publish(ordered, "a", "a")
    g = store_of(ordered)
    open_breaker(ordered, g.gid)
    set_rows(ordered, [a1], state="dead", error_class="systemic", refundable_attempts=1, refunds=3)
    set_rows(ordered, [a1], error_epoch=1)
    settled(ordered, [a2])
    with ordered.begin() as conn:
        probe = g.claim_probe(conn, 1, max_refunds=3, hold=5.0)
    assert probe is not None and probe.id == a2


def leased_of(engine: Engine, gid: int) -> list[int]:
    with engine.connect() as conn:
        return sorted(
            conn.scalars(select(d.c.message_id).where(d.c.group_id == gid, d.c.state == "leased"))
        )


def waits_for_lock(engine: Engine) -> bool:
    """A requeue's lock of its keys' later rows (`lock_key_successors`) waits."""
    with engine.connect() as conn:
        return bool(
            conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%dead_of_key%'"
                )
            )
        )


def test_a_requeue_racing_a_claim_does_not_start_two_messages_of_a_key(ordered: Engine):
    """A requeue that makes an earlier dead message ready while a claim of the later one
    has not committed yet: a claim that sees the requeue but not that lease (ready
    to it) took the earlier message too, and both ran at once. The requeue now waits
    for the claims in flight on its keys' rows."""
    a1, a2 = publish(ordered, "a", "a")
    set_rows(ordered, [a1], state="dead", error_class="permanent")
    settled(ordered, [a2])
    first, second = store_of(ordered, member="m1"), store_of(ordered, member="m2")
    done = threading.Event()
    with ordered.connect() as slow:
        slow.begin()
        assert [c.id for c in first.claim(slow, 10, 0)] == [a2]  # not committed yet

        def requeue() -> None:
            requeue_rows(ordered, "g", [a1], reason="race")
            done.set()

        thread = threading.Thread(target=requeue, daemon=True)
        thread.start()
        # the requeue either finishes at once (the race) or waits for the claim
        wait_until(lambda: done.is_set() or waits_for_lock(ordered), 30.0, "the requeue")
        taken = claim(ordered, second)
        slow.commit()
    thread.join(30)
    assert done.is_set()
    assert taken == [] and leased_of(ordered, second.gid) == [a2]
