"""Races between publish, subscribe, retention and the frontier, with real threads.

Every test runs real concurrent transactions on their own connections against
the real server, bounded in time: threads are joined with timeouts, and where a
test needs one transaction to wait behind another it polls `pg_stat_activity`
for that backend's lock wait (or for the thread's end) instead of sleeping.
The deterministic tests pin one interleaving; the stress tests repeat the race
with several publishers until it would have shown (see each test).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers import FAST, across_groups, store_of, wait_until
from sqlalchemy import Connection, Engine, Text, cast, func, select, text, tuple_, update

import pgq
from pgq import schema as t
from pgq.store import GroupStore, group_info

JOIN = 30.0
"""Seconds any thread of these tests may take to finish once asked."""


class Session(threading.Thread):
    """`fn(conn)` in one transaction on its own connection, in a thread.

    The backend pid is known (`pid`) before `fn` starts, so the test can watch
    that backend wait for a lock; `finish()` joins with a timeout and re-raises
    what the thread raised.
    """

    def __init__(self, engine: Engine, fn: Callable[[Connection], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.engine, self.fn = engine, fn
        self.pid: int | None = None
        self.started_fn = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.engine.connect() as conn:
                self.pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                conn.commit()
                self.started_fn.set()
                with conn.begin():
                    self.result = self.fn(conn)
        except BaseException as exc:
            self.error = exc
        finally:
            self.started_fn.set()

    def finish(self, timeout: float = JOIN) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} still running after {timeout:g}s"
        if self.error is not None:
            raise self.error
        return self.result


def start(engine: Engine, fn: Callable[[Connection], Any], name: str) -> Session:
    session = Session(engine, fn, name)
    session.start()
    assert session.started_fn.wait(JOIN), f"{name} did not connect"
    return session


def waits_for_lock(engine: Engine, pid: int | None) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).scalar()
        )


def blocked_or_done(engine: Engine, session: Session) -> None:
    """Wait until `session` waits for a lock or has finished (whichever the code does)."""
    wait_until(
        lambda: not session.is_alive() or waits_for_lock(engine, session.pid),
        JOIN,
        f"{session.name} to wait for a lock or finish",
    )


def blocked(engine: Engine, session: Session) -> None:
    """Wait until `session` waits for a lock (failing if it finished instead)."""
    blocked_or_done(engine, session)
    assert session.is_alive(), f"{session.name} finished without waiting: {session.error!r}"


# -- 1. publish racing subscribe(start="earliest") -----------------------------------


def message_ids(engine: Engine, topic_id: int | None = None) -> set[int]:
    m = t.message
    query = select(m.c.id)
    if topic_id is not None:
        query = query.where(m.c.topic_id == topic_id)
    with across_groups(engine) as conn:  # every topic's, unless one is given
        return set(conn.scalars(query))


def row_ids(engine: Engine, group: str) -> set[int]:
    d, gid = t.delivery, group_info(engine, group).id
    with engine.connect() as conn:
        return set(conn.scalars(select(d.c.message_id).where(d.c.group_id == gid)))


def subscribe(group: str, topic: str = "orders", barrier: threading.Barrier | None = None) -> Any:
    def run(conn: Connection) -> None:
        if barrier is not None:
            barrier.wait()
        pgq.subscribe(conn, group, topic, start="earliest")

    return run


def test_a_publish_waiting_behind_a_subscribe_writes_the_new_groups_rows(orders):
    """The publish starts (and takes its first snapshot) while the subscribe holds the
    topic lock; it must still write the new group's rows once the subscribe commits.
    Failed on every run before the fix (the statement's snapshot predated the wait)."""
    with orders.connect() as conn:
        conn.begin()
        pgq.subscribe(conn, "late", "orders", start="earliest")
        publisher = start(orders, lambda c: pgq.publish(c, "orders", {"n": 1}), "publisher")
        blocked(orders, publisher)
        conn.commit()
    mid = publisher.finish()
    assert row_ids(orders, "late") == {mid}


def test_subscribe_waits_for_a_long_publishing_transaction_and_backfills_all_of_it(orders):
    """Publisher first: the subscribe waits for the open publishing transaction, which
    keeps publishing meanwhile; the backfill has everything it committed."""
    pgq.subscribe(orders, "billing", "orders")
    with orders.connect() as conn:
        conn.begin()
        first = pgq.publish(conn, "orders", {"n": 1})
        subscriber = start(orders, subscribe("late"), "subscriber")
        blocked(orders, subscriber)
        second = pgq.publish_many(conn, "orders", [{"n": 2}, {"n": 3}])
        conn.commit()
    subscriber.finish()
    assert row_ids(orders, "late") == {first, *second} == row_ids(orders, "billing")


def test_a_transaction_begun_before_a_subscribe_publishes_to_the_new_group(orders):
    """The caller's transaction started (and read) before the subscribe committed; a
    publish in it afterwards still writes the new group's row."""
    with orders.connect() as conn:
        conn.begin()
        m = t.message
        conn.execute(select(func.count()).where(m.c.topic_id == topic_id_of(orders, "orders")))
        pgq.subscribe(orders, "late", "orders", start="earliest")
        mid = pgq.publish(conn, "orders", {"n": 1})
        conn.commit()
    assert row_ids(orders, "late") == {mid}


def test_publishing_on_a_connection_joins_its_transaction_begun_or_not(orders):
    """The lock and the insert go to the driver as a pipeline: still the caller's
    transaction, whether it began it or SQLAlchemy's autobegin would have."""
    with orders.connect() as conn:
        gone = pgq.publish(conn, "orders", {"n": 1})  # no begin(): autobegin
        conn.rollback()
        kept = pgq.publish(conn, "orders", {"n": 2})
        conn.commit()
        conn.begin()
        also_gone = pgq.publish(conn, "orders", {"n": 3})
        conn.rollback()
    assert message_ids(orders) == {kept} == row_ids(orders, "billing")
    assert gone < kept < also_gone


def test_publishers_racing_subscribes_leave_no_group_without_a_message(orders):
    """Three publishers (one publishing twice per transaction) while eight groups
    subscribe with start="earliest", one after another: every group has a row for
    every message. Before the fix every run failed, each new group missing the
    messages in flight while it subscribed."""
    stop = threading.Event()
    published = [0, 0, 0]
    errors: list[BaseException] = []

    def publisher(n: int) -> None:
        try:
            while not stop.is_set():
                if n == 2:
                    with orders.begin() as conn:
                        pgq.publish(conn, "orders", {"p": n})
                        pgq.publish_many(conn, "orders", [{"p": n}, {"p": n}])
                else:
                    pgq.publish_many(orders, "orders", [{"p": n}] * (n + 1))
                published[n] += 1
        except BaseException as exc:
            errors.append(exc)

    def progress() -> int:
        return sum(published)

    threads = [threading.Thread(target=publisher, args=(n,), name=f"pub-{n}") for n in range(3)]
    for thread in threads:
        thread.start()
    groups = [f"g{i}" for i in range(8)]
    try:
        for group in groups:
            seen = progress()
            wait_until(lambda seen=seen: progress() >= seen + 20, JOIN, "publishers to go on")
            start(orders, subscribe(group), f"subscribe-{group}").finish()
    finally:
        stop.set()
        for thread in threads:
            thread.join(JOIN)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    every = message_ids(orders)
    missing = {g: len(every - row_ids(orders, g)) for g in groups}
    assert missing == dict.fromkeys(groups, 0)


# -- 2. retention racing subscribe ----------------------------------------------------


def orphans(engine: Engine) -> list[tuple[int, int, str]]:
    """Delivery rows whose message is gone: (group id, message id, state). Two reads,
    once the race is over (on Citus `delivery` and `message` cannot be joined)."""
    d, m = t.delivery, t.message
    with across_groups(engine) as conn:  # every group's rows, every topic's messages
        rows = conn.execute(select(d.c.group_id, d.c.message_id, d.c.state)).all()
        kept = set(conn.scalars(select(m.c.id)))
    return [(gid, mid, state) for gid, mid, state in rows if mid not in kept]


def topic_id_of(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(t.topic.c.id).where(t.topic.c.name == topic)) or 0)


def retention(engine: Engine, topic: str, barrier: threading.Barrier | None = None) -> Any:
    """Retention (retention 0) of `topic` until nothing is left to delete, as any
    member runs it (the store's group does not matter to it)."""
    topic_id = topic_id_of(engine, topic)
    store = GroupStore(0, "-", topic, "retention", 30.0, 3)

    def run(conn: Connection) -> int:
        if barrier is not None:
            barrier.wait()
        total = 0
        while deleted := store.expire_messages(conn, topic_id, 0.0):
            total += deleted
        return total

    return run


def claimable(engine: Engine, group: str) -> tuple[int, int]:
    """(ready rows of `group`, rows one claim of up to 1,024 returns), rolled back."""
    store = store_of(engine, group, "claimer")
    d = t.delivery
    with engine.connect() as conn:
        conn.begin()
        ready = conn.scalar(
            select(func.count()).where(d.c.group_id == store.gid, d.c.state == "ready")
        )
        claimed = store.claim(conn, 1024, 0)
        conn.rollback()
    return int(ready or 0), len(claimed)


@pytest.fixture
def unheld(engine: Engine) -> tuple[Engine, list[int]]:
    """Topic `orders` with 200 messages published before any group existed: no group
    holds them, so retention (retention 0) may delete them all."""
    pgq.create_topic(engine, "orders")
    return engine, pgq.publish_many(engine, "orders", [{"n": i} for i in range(200)])


def test_retention_waiting_behind_a_subscribe_spares_the_backfilled_messages(unheld):
    """Subscribe first: its backfill wrote rows for the 200 messages but has not
    committed when retention runs. Before the fix retention deleted all 200 (it did
    not see the rows), leaving 200 ready rows without their message, which every
    claim picked and dropped (`claimable` was (200, 0))."""
    engine, ids = unheld
    with engine.connect() as conn:
        conn.begin()
        pgq.subscribe(conn, "late", "orders", start="earliest")
        expiry = start(engine, retention(engine, "orders"), "retention")
        blocked_or_done(engine, expiry)
        conn.commit()
    expiry.finish()
    assert orphans(engine) == []
    assert row_ids(engine, "late") == set(ids) == message_ids(engine)
    assert claimable(engine, "late") == (200, 200)


def test_subscribe_waiting_behind_retention_backfills_only_what_survives(unheld):
    """Retention first: it deleted the 200 messages but has not committed when the
    subscribe runs. Before the fix the backfill still saw them and wrote 200 rows
    without their message."""
    engine, _ = unheld
    with engine.connect() as conn:
        conn.begin()
        assert retention(engine, "orders")(conn) == 200
        subscriber = start(engine, subscribe("late"), "subscriber")
        blocked_or_done(engine, subscriber)
        conn.commit()
    subscriber.finish()
    assert orphans(engine) == []
    assert row_ids(engine, "late") == set() == message_ids(engine)
    assert claimable(engine, "late") == (0, 0)


def test_subscribes_racing_retention_never_leave_a_row_without_its_message(engine):
    """Twenty rounds, each a fresh topic of 300 unheld messages whose subscribe and
    retention start together: whatever the order, no row lacks its message and
    every ready row is claimable. Before the fix most rounds left orphans."""
    bad: dict[str, int] = {}
    for n in range(20):
        topic = f"r{n}"
        pgq.create_topic(engine, topic)
        pgq.publish_many(engine, topic, [{"n": i} for i in range(300)])
        go = threading.Barrier(2, timeout=JOIN)
        sessions = [
            start(engine, retention(engine, topic, go), f"retention-{n}"),
            start(engine, subscribe(f"g{n}", topic, go), f"subscribe-{n}"),
        ]
        for session in sessions:
            session.finish()
        ready, claimed = claimable(engine, f"g{n}")
        if ready != claimed:
            bad[topic] = ready - claimed
    assert bad == {}
    assert orphans(engine) == []


# -- 3. retention deletes what every group finished ------------------------------------


def set_state(engine: Engine, group: str, ids: list[int], state: str) -> None:
    d = t.delivery
    gid = group_info(engine, group).id
    with engine.begin() as conn:
        conn.execute(
            update(d)
            .where(d.c.group_id == gid, d.c.message_id.in_(ids))
            .values(state=state, error_class="permanent" if state == "dead" else None)
        )


def prune_to(engine: Engine, group: str, mid: int) -> int:
    """Put `group`'s frontier right after message `mid` and prune behind it, as the
    frontier's own pruning does (set directly: the real advance waits for the
    cluster-wide xmin, which another session of a shared server may hold)."""
    gs, d = t.group_state, t.delivery
    store = store_of(engine, group, "pruner")
    with engine.begin() as conn:
        row = (d.c.group_id == store.gid) & (d.c.message_id == mid)
        xid = select(d.c.xid).where(row).scalar_subquery()
        conn.execute(
            update(gs).where(gs.c.group_id == store.gid).values(committed_xid=xid, committed_id=mid)
        )
        return store.prune_behind(conn)


def test_retention_deletes_what_every_group_finished_despite_dead_and_ready_rows(orders):
    """A message goes when every group of its topic finished it and pruned its row,
    whatever other rows the groups hold. Before the fix retention deleted nothing:
    one dead or ready row anywhere in a group held back the whole topic."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(10)])
    pgq.subscribe(orders, "audit", "orders", start="earliest")
    pgq.subscribe(orders, "newcomer", "orders", start="latest")  # no rows: holds nothing
    set_state(orders, "billing", ids[:8], "done")
    set_state(orders, "billing", [ids[8]], "dead")  # resolved, but kept
    assert prune_to(orders, "billing", ids[8]) == 8  # 8 (dead) and 9 (ready) stay
    set_state(orders, "audit", [*ids[:6], ids[7]], "done")
    assert prune_to(orders, "audit", ids[5]) == 6  # 7 is done but ahead of the frontier
    store = store_of(orders, "billing")
    with orders.begin() as conn:  # too young for a one-hour retention
        assert store.expire_messages(conn, topic_id_of(orders, "orders"), 3600.0) == 0
    with orders.begin() as conn:
        assert retention(orders, "orders")(conn) == 6
    assert message_ids(orders) == set(ids[6:])
    assert orphans(orders) == []


# -- 7. the frontier decides from one snapshot -------------------------------------------


def test_the_frontier_never_passes_an_unresolved_message_under_load(orders):
    """Three publishers (one holding each transaction open until another publisher
    commits, so commits come out of id order) while two members consume and a checker
    advances the frontier in a loop for eight seconds: right after every advance, in
    the same transaction, no ready or leased row is at or behind `committed` in
    (xid, id) order, and the frontier never moves back. Before the fix every run
    failed (a publish committing between the frontier's statements slipped past)."""
    stop = threading.Event()
    commit_seen = threading.Event()
    errors: list[BaseException] = []
    published = [0, 0, 0]
    handled: set[int] = set()
    store = store_of(orders, "billing", "checker")
    d, gs = t.delivery, t.group_state

    def publisher(n: int) -> None:
        try:
            while not stop.is_set():
                if n == 0:
                    with orders.begin() as conn:
                        commit_seen.clear()
                        pgq.publish(conn, "orders", {"p": n})
                        commit_seen.wait(1.0)  # let a later id commit first
                        pgq.publish(conn, "orders", {"p": n})
                else:
                    pgq.publish_many(orders, "orders", [{"p": n}] * n)
                    commit_seen.set()
                published[n] += 1
        except BaseException as exc:
            errors.append(exc)

    frontier = select(cast(gs.c.committed_xid, Text), gs.c.committed_id).where(
        gs.c.group_id == store.gid
    )
    behind = (
        select(d.c.message_id, d.c.state)
        .join(gs, gs.c.group_id == d.c.group_id)
        .where(gs.c.group_id == store.gid, d.c.state.in_(["ready", "leased"]))
        .where(tuple_(d.c.xid, d.c.message_id) <= tuple_(gs.c.committed_xid, gs.c.committed_id))
        .limit(5)
    )
    violations: list[Any] = []
    moved_back: list[Any] = []
    advances = 0
    last = (0, 0)
    members = [
        pgq.Consumer(
            orders, "billing", lambda m: handled.add(m.id), workers=2, name=f"m{i}", **FAST
        )
        for i in range(2)
    ]
    threads = [threading.Thread(target=publisher, args=(n,), name=f"pub-{n}") for n in range(3)]
    for member in members:
        member.start()
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            with orders.begin() as conn:
                if store.advance_frontier(conn) is None:
                    continue  # a member is advancing it right now
                cx, cid = conn.execute(frontier).one()
                if cid is None:
                    continue
                advances += 1
                now = (int(cx), cid)
                if now < last:
                    moved_back.append((last, now))
                last = now
                found = conn.execute(behind).all()
                if found:
                    violations.append((now, [tuple(r) for r in found]))
    finally:
        stop.set()
        for thread in threads:
            thread.join(JOIN)
        try:
            every = message_ids(orders)
            wait_until(lambda: handled >= every, JOIN, "every message to be handled")
        finally:
            for member in members:
                member.stop()
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    assert min(published) > 0 and advances > 100, (published, advances)
    assert moved_back == []
    assert violations == [], f"{len(violations)} of {advances} advances: {violations[:5]}"


# -- 12a. an earliest subscribe keeps a message's delay ---------------------------------


def test_an_earliest_subscribe_keeps_the_delay_of_a_delayed_message(orders):
    """The new group's row of a message published with `delay` becomes claimable when
    the message does, not at once. Before the fix the backfilled row was available
    at once (its available_at was the subscribe's time, an hour early)."""
    later = pgq.publish(orders, "orders", {"n": 1}, delay=3600)
    now = pgq.publish(orders, "orders", {"n": 2})
    pgq.subscribe(orders, "late", "orders", start="earliest")
    d = t.delivery
    with orders.connect() as conn:
        due = dict(
            conn.execute(
                select(d.c.group_id, d.c.available_at).where(d.c.message_id == later)
            ).all()
        )
    billing, late = store_of(orders, "billing"), store_of(orders, "late")
    assert due[late.gid] == due[billing.gid]
    with orders.connect() as conn:
        conn.begin()
        assert [c.id for c in late.claim(conn, 8, 0)] == [now]
        conn.rollback()
