"""Ordered groups (DESIGN §7, decision 0044) against a real server: within a group
subscribed with `ordered=True`, the messages of one key are leased one at a time in
frontier order; other keys, and messages without a key, run in parallel. A retry or a
delay holds the key, a dead message frees it, a reclaim keeps the order, and an
earlier message whose publish has not committed yet holds the later ones back."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
from helpers import (
    DISTRIBUTED,
    FAST,
    across_groups,
    assert_usage_error,
    invoke,
    set_rows,
    store_of,
    wait_until,
)
from sqlalchemy import BigInteger, Engine, Text, cast, func, select, text, update

import pgq
from pgq import schema as t
from pgq.errors import UsageError
from pgq.records import Claimed, Outcome, OutcomeKind
from pgq.store import GroupStore

JOIN = 60.0
"""Seconds the consumers of a test may take to drain."""


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    return ()


HELD: dict[int, Claimed] = {}
"""The leases the tests' claims took, by message id (what `finish` writes outcomes for)."""


SETTLE = 15.0
"""Seconds a test waits for rows it expects to be claimable: a keyed row waits for every
write transaction begun before its publish to end (xmin), and other sessions of the
server (other tests, other databases) may hold one open for a moment."""


def claim(engine: Engine, store: GroupStore, expect: list[int] | None = None) -> list[int]:
    """What `store`'s claims lease, sorted: one claim, or with `expect` claims until
    as many rows as it lists are leased (or `SETTLE` passed)."""
    got: list[int] = []
    deadline = time.monotonic() + SETTLE
    while True:
        with engine.begin() as conn:
            claimed = store.claim(conn, 100, 0)
        HELD.update((c.id, c) for c in claimed)
        got += [c.id for c in claimed]
        if expect is None or len(got) >= len(expect) or time.monotonic() > deadline:
            return sorted(got)
        time.sleep(0.02)


def claim_probe(engine: Engine, store: GroupStore) -> Claimed | None:
    """The probe `store`'s member may take in the OPEN epoch 1 (waiting up to `SETTLE`
    for one, as `claim` does)."""
    deadline = time.monotonic() + SETTLE
    while True:
        with engine.begin() as conn:
            probe = store.claim_probe(conn, 1, max_refunds=3, hold=5.0)
        if probe is not None or time.monotonic() > deadline:
            return probe
        time.sleep(0.02)


def publish(engine: Engine, *keys: str | None) -> list[int]:
    return [pgq.publish(engine, "orders", {"i": i}, key=k) for i, k in enumerate(keys)]


def finish(engine: Engine, store: GroupStore, ids: list[int], kind: str = "done") -> None:
    """Write outcome `kind` (a retry is due in an hour) for the leases of `ids`."""
    outcomes = [Outcome(HELD.pop(i), OutcomeKind(kind), delay=3600.0) for i in ids]
    with engine.begin() as conn:
        assert store.record(conn, outcomes) == {o.claimed.lease for o in outcomes}


# --- the claim ------------------------------------------------------------------


def test_one_message_per_key_at_a_time_in_publish_order(ordered: Engine):
    a1, a2, b1, none1, a3, b2, none2 = publish(ordered, "a", "a", "b", None, "a", "b", None)
    g = store_of(ordered)
    assert claim(ordered, g, expect=[a1, b1, none1, none2]) == [
        a1,
        b1,
        none1,
        none2,
    ]  # the heads and the keyless
    assert claim(ordered, g) == []  # a and b are running
    finish(ordered, g, [a1])
    assert claim(ordered, g, expect=[a2]) == [a2]
    finish(ordered, g, [b1, a2])
    assert claim(ordered, g, expect=[a3, b2]) == [a3, b2]
    # the unordered group on the same topic takes everything at once
    assert claim(
        ordered, store_of(ordered, "u"), expect=sorted([a1, a2, b1, none1, a3, b2, none2])
    ) == sorted([a1, a2, b1, none1, a3, b2, none2])


def test_only_ordered_groups_rows_carry_the_key(ordered: Engine):
    [a1] = publish(ordered, "a")
    pgq.subscribe(ordered, "late", "orders", ordered=True)  # backfilled from earliest
    pgq.subscribe(ordered, "late-u", "orders")
    d, g = t.delivery, t.consumer_group
    with across_groups(ordered) as conn:  # the message's row in every group
        keys = dict(
            conn.execute(
                select(g.c.name, d.c.key)
                .join(g, g.c.id == d.c.group_id)
                .where(d.c.message_id == a1)
            ).all()
        )
    assert keys == {"g": "a", "u": None, "late": "a", "late-u": None}


def test_a_retry_holds_its_key_and_a_dead_message_frees_it(ordered: Engine):
    a1, a2 = publish(ordered, "a", "a")
    g = store_of(ordered)
    assert claim(ordered, g, expect=[a1]) == [a1]
    finish(ordered, g, [a1], kind="retry")  # due in an hour
    assert claim(ordered, g) == []  # a1 waits for its retry and holds a2 back
    set_rows(ordered, [a1], state="dead", error_class="permanent")
    assert claim(ordered, g, expect=[a2]) == [a2]


def test_a_delayed_message_holds_its_key(ordered: Engine):
    a1 = pgq.publish(ordered, "orders", {"i": 1}, key="a", delay=3600)
    [a2, b1] = publish(ordered, "a", "b")
    assert claim(ordered, store_of(ordered), expect=[b1]) == [b1]
    set_rows(ordered, [a1], available_at=text("now()"))
    assert claim(ordered, store_of(ordered), expect=[a1]) == [a1]
    assert a2 > a1


def test_a_reclaimed_message_keeps_its_place(ordered: Engine):
    a1, a2 = publish(ordered, "a", "a")
    stale = store_of(ordered, member="stale", lease=0.2)
    assert claim(ordered, stale, expect=[a1]) == [a1]
    time.sleep(0.3)  # past the lease: the sweep below must find it expired
    other = store_of(ordered, member="other")
    with ordered.begin() as conn:
        other.sweep(conn)
    assert claim(ordered, other, expect=[a1]) == [a1]
    finish(ordered, other, [a1])
    assert claim(ordered, other, expect=[a2]) == [a2]


def test_an_earlier_row_made_ready_again_waits_for_the_running_one(ordered: Engine):
    """A refund (or a requeue) that makes an earlier dead row ready while a later row
    of its key runs does not start it beside that row: one at a time, always."""
    a1, a2 = publish(ordered, "a", "a")
    g = store_of(ordered)
    set_rows(ordered, [a1], state="dead", error_class="systemic")
    assert claim(ordered, g, expect=[a2]) == [a2]
    set_rows(ordered, [a1], state="ready")  # what a close's refund does
    assert claim(ordered, g) == []
    finish(ordered, g, [a2])
    assert claim(ordered, g, expect=[a1]) == [a1]


def test_an_uncommitted_earlier_publish_holds_the_key_back(ordered: Engine):
    """Frontier order: a message whose publishing transaction began first (its xid is
    lower) comes first, even when a later one commits before it. Until it commits,
    the later message of its key waits; other keys and the unordered group do not."""
    with ordered.connect() as early:
        early.begin()
        [a1] = pgq.publish_many(early, "orders", [{"i": 1}], key="a")
        a2, b1 = publish(ordered, "a", "b")
        g = store_of(ordered)
        # b1 too is younger than the open transaction: no key can pass a publish
        # that has not ended, whatever its key (its key is not known yet)
        assert claim(ordered, g) == []
        assert claim(ordered, store_of(ordered, "u"), expect=sorted([a2, b1])) == sorted([a2, b1])
        early.commit()
    assert claim(ordered, g, expect=[a1, b1]) == [a1, b1]
    finish(ordered, g, [a1])
    assert claim(ordered, g, expect=[a2]) == [a2]


def test_a_probe_keeps_the_order(ordered: Engine):
    """While the breaker is OPEN a dead row the outage charged holds its key (the close
    will refund it, and it must not come back behind a later message of its key): the
    probe takes it, not the later message that is due."""
    a1, a2 = publish(ordered, "a", "a")
    g = store_of(ordered)
    br = t.breaker
    with ordered.begin() as conn:
        conn.execute(
            update(br)
            .where(br.c.group_id == g.gid)
            .values(state="OPEN", epoch=1, next_probe_at=text("now()"))
        )
    set_rows(ordered, [a1], state="dead", error_class="systemic", refundable_attempts=1)
    set_rows(ordered, [a1], error_epoch=1)
    probe = claim_probe(ordered, g)
    assert probe is not None and probe.id == a1
    # in the unordered group the due row comes first, as always
    u = store_of(ordered, "u")
    with ordered.begin() as conn:
        conn.execute(
            update(br)
            .where(br.c.group_id == u.gid)
            .values(state="OPEN", epoch=1, next_probe_at=text("now()"))
        )
    probe = claim_probe(ordered, u)
    assert probe is not None and probe.id == a2


def test_a_dead_row_a_close_still_owes_holds_its_key(ordered: Engine):
    """After the close, until the reconciliation has made the outage's dead rows ready
    again, they hold their keys: a later message does not run before them."""
    a1, a2 = publish(ordered, "a", "a")
    g = store_of(ordered)
    set_rows(ordered, [a1], state="dead", error_class="systemic", refundable_attempts=1)
    set_rows(ordered, [a1], error_epoch=1)
    br = t.breaker
    with ordered.begin() as conn:
        conn.execute(
            update(br)
            .where(br.c.group_id == g.gid)
            .values(epoch=2, reconcile_from_epoch=1, reconcile_epoch=2)
        )
    assert claim(ordered, g) == []
    with ordered.begin() as conn:  # reconciled: the row was refunded or left dead
        conn.execute(
            update(br)
            .where(br.c.group_id == g.gid)
            .values(reconcile_from_epoch=None, reconcile_epoch=None)
        )
    assert claim(ordered, g, expect=[a2]) == [
        a2
    ]  # a dead row the outage does not owe frees its key


# --- subscribe ------------------------------------------------------------------


def test_whether_a_group_is_ordered_is_fixed_at_subscribe(ordered: Engine):
    pgq.subscribe(ordered, "g", "orders", ordered=True)  # idempotent
    with pytest.raises(UsageError, match="is ordered"):
        pgq.subscribe(ordered, "g", "orders")
    with pytest.raises(UsageError, match="is not ordered"):
        pgq.subscribe(ordered, "u", "orders", ordered=True)


def test_the_cli_subscribes_an_ordered_group_and_topics_shows_it(orders: Engine, pgq_env):
    made = invoke(pgq_env, "subscribe", "og", "orders", "--ordered")
    assert (made.exit_code, made.stdout.strip()) == (0, "ordered group og on topic orders")
    refused = invoke(pgq_env, "subscribe", "og", "orders")
    assert_usage_error(refused.exit_code, refused.stderr, contains="is ordered")
    assert invoke(pgq_env, "subscribe", "plain", "orders").exit_code == 0
    listed = invoke(pgq_env, "topics", "--json")
    [topic] = json.loads(listed.stdout)["topics"]
    assert topic["groups"] == [{"group": "og", "ordered": True}, {"group": "plain"}]
    assert "og (ordered),plain" in invoke(pgq_env, "topics").stdout


# --- members running -----------------------------------------------------------


class Intervals:
    """What handlers did, per key: (message id, start, end) in the order they ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, list[tuple[int, float, float]]] = defaultdict(list)

    def handler(self, fail_first: set[int]) -> pgq.Handler:
        def handle(msg: pgq.Message) -> None:
            start = time.monotonic()
            time.sleep(random.uniform(0, 0.004))
            if msg.id in fail_first and msg.attempt == 1:
                raise RuntimeError("fails once")
            with self.lock:
                assert msg.key is not None
                self.by_key[msg.key].append((msg.id, start, time.monotonic()))

        return handle


def check_order(intervals: Intervals, published: dict[str, list[int]]) -> None:
    """Per key: each message handled once to success, in publish order, and no
    handling began before the one before it ended."""
    for key, ids in published.items():
        seen = intervals.by_key[key]
        assert [i for i, _, _ in seen] == ids, key
        for (_, _, end), (_, start, _) in itertools.pairwise(seen):
            assert start >= end, (key, seen)


@pytest.fixture
def three_members(ordered: Engine) -> Iterator[list[pgq.Consumer]]:
    consumers: list[pgq.Consumer] = []
    yield consumers
    for c in consumers:
        c.stop(timeout=10)


def test_three_members_keep_each_keys_order(ordered: Engine, three_members: list[pgq.Consumer]):
    """Three members with four workers each on 40 keys of 15 messages, published
    interleaved, some failing once (a retry holds the key): every key's messages
    are handled one at a time, in publish order."""
    keys = [f"k{i}" for i in range(40)]
    sequence = [k for _ in range(15) for k in random.sample(keys, len(keys))]
    published: dict[str, list[int]] = defaultdict(list)
    for lo in range(0, len(sequence), 50):
        with ordered.begin() as conn:
            for k in sequence[lo : lo + 50]:
                published[k].append(pgq.publish_many(conn, "orders", [{"k": k}], key=k)[0])
    fail_first = set(random.sample([i for ids in published.values() for i in ids], 60))
    intervals = Intervals()
    settings = {**FAST, "workers": 4, "retry_backoff": 0.01}
    for n in range(3):
        c = pgq.Consumer(ordered, "g", intervals.handler(fail_first), name=f"m{n}", **settings)
        three_members.append(c)
        c.start()
    deadline = time.monotonic() + JOIN
    total = len(sequence)
    while sum(len(v) for v in intervals.by_key.values()) < total:
        assert time.monotonic() < deadline, "the members did not drain the group"
        time.sleep(0.05)
    check_order(intervals, published)


@pytest.mark.skipif(
    DISTRIBUTED,
    reason="plays a move on one server (xids rewritten by hand); on Citus the real moves"
    " are tests/citus/test_growth.py",
)
def test_after_a_shard_move_a_keys_messages_keep_their_order(ordered: Engine):
    """Rows that came from another server (a Citus shard move, decision 0047) carry
    that server's xids, which do not compare with this one's: no keyed row is leased
    until the group's frontier is rebased, and the rebase keeps each key's order.
    Here `a1` came from a server whose xid for it is just above the one this server
    gave `a3`, published after the move: by xids alone `a3` came first."""
    a1, a2, a3, filler = publish(ordered, "a", "a", "a", None)
    g = store_of(ordered)
    d, gs = t.delivery, t.group_state
    with ordered.begin() as conn:
        x3 = conn.scalar(
            select(cast(d.c.xid, Text)).where(d.c.message_id == a3, d.c.group_id == g.gid)
        )
        moved = cast(cast(cast(x3, BigInteger) + 1, Text), t.XID8())
        conn.execute(
            update(d).where(d.c.group_id == g.gid, d.c.message_id.in_([a1, a2])).values(xid=moved)
        )
        conn.execute(update(gs).where(gs.c.group_id == g.gid).values(xid_space=42))

    def past_xmin() -> bool:  # every row committed as far as any snapshot can tell
        with ordered.connect() as conn:
            xmin = conn.scalar(
                select(cast(func.pg_snapshot_xmin(func.pg_current_snapshot()), Text))
            )
        return int(xmin) > int(x3) + 1

    wait_until(past_xmin, SETTLE, "the server's xmin past the rows' xids")
    assert claim(ordered, g) == [filler]  # no keyed row yet (by xids alone: a3)
    with ordered.begin() as conn:
        g.advance_frontier(conn)  # rebased: this server's space
    assert claim(ordered, g, expect=[a1]) == [a1]
    finish(ordered, g, [a1])
    assert claim(ordered, g, expect=[a2]) == [a2]
