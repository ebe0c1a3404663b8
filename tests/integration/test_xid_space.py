"""A group's frontier counts in one server's xids, and starts again when its rows come
from another server (decision 0047).

On Citus, moving a group's shard to another node (`citus_move_shard_placement`, a
rebalance) copies its rows with the xids of the node they were written on, and the
new node counts its own. On one server the same happens when a dump is restored on
another server. Here the rows and the frontier are made to come from a server ahead
of this one (their xids above this server's), as a move to a node that has run
fewer transactions leaves them: before decision 0047 the frontier then stalled (no
moved row ever looked committed) and a message published after the move sat behind
it while still ready. `tests/citus/test_growth.py` moves real shards under load.
"""

from __future__ import annotations

from typing import Any

from fixtures.released import restore
from helpers import FAST, store_of, wait_until
from sqlalchemy import BigInteger, Engine, Text, cast, func, select, text, tuple_, update

import pgq
from pgq import schema as t
from pgq.sql import frontier as frontier_sql

d, gs = t.delivery, t.group_state

AHEAD = 1_000_000
"""How far ahead of this server the other server's xids were."""


def system_identifier(engine: Engine) -> int:
    """The xid space this server gives its groups' frontiers (decision 0047)."""
    with engine.connect() as conn:
        return int(conn.scalar(select(frontier_sql.SPACE).select_from(gs).limit(1)))


def frontier(engine: Engine, gid: int) -> tuple[int, int | None, int | None]:
    with engine.connect() as conn:
        row = conn.execute(
            select(cast(gs.c.committed_xid, Text), gs.c.committed_id, gs.c.xid_space).where(
                gs.c.group_id == gid
            )
        ).one()
    return int(row[0]), row[1], row[2]


def unresolved_behind(engine: Engine, gid: int) -> list[int]:
    """Ready or leased rows at or behind the frontier, in its own space only (a
    frontier of another space promises nothing)."""
    with engine.connect() as conn:
        return list(
            conn.scalars(
                select(d.c.message_id)
                .join(gs, gs.c.group_id == d.c.group_id)
                .where(d.c.group_id == gid, d.c.state.in_(["ready", "leased"]))
                .where(gs.c.xid_space == system_identifier(engine))
                .where(
                    tuple_(d.c.xid, d.c.message_id) <= tuple_(gs.c.committed_xid, gs.c.committed_id)
                )
            )
        )


def test_a_group_counts_in_its_servers_xids_from_its_subscribe(orders):
    store = store_of(orders, "billing", "m")
    assert frontier(orders, store.gid)[2] == system_identifier(orders)


def test_rows_from_a_server_ahead_get_a_frontier_that_moves_and_passes_nothing_unresolved(
    orders,
):
    store = store_of(orders, "billing", "m")
    ids = pgq.publish_many(orders, "orders", [{"n": n} for n in range(6)])
    with orders.begin() as conn:
        # as a shard move from a node ahead leaves them: xids above this server's,
        # the frontier at the third message in that server's space
        conn.execute(
            update(d)
            .where(d.c.group_id == store.gid)
            .values(xid=cast(cast(cast(cast(d.c.xid, Text), BigInteger) + AHEAD, Text), t.XID8()))
        )
        conn.execute(update(d).where(d.c.message_id.in_(ids[:4] + ids[5:])).values(state="done"))
        moved_xid = conn.scalar(select(cast(d.c.xid, Text)).where(d.c.message_id == ids[2]))
        conn.execute(
            update(gs)
            .where(gs.c.group_id == store.gid)
            .values(committed_xid=moved_xid, committed_id=ids[2], xid_space=42)
        )
    late = pgq.publish(orders, "orders", {"n": "after the move"})

    with orders.begin() as conn:
        store.advance_frontier(conn)

    _, committed, space = frontier(orders, store.gid)
    assert space == system_identifier(orders)
    # the moved rows are committed here: the frontier passes the done ones up to the
    # first ready one (the fifth), and the message published after the move is past it
    assert committed == ids[3]
    assert unresolved_behind(orders, store.gid) == []
    with orders.connect() as conn:
        rows = conn.execute(select(d.c.message_id, d.c.state).where(d.c.group_id == store.gid))
        left = {row.message_id: row.state for row in rows}
    assert left == {ids[4]: "ready", ids[5]: "done", late: "ready"}

    # and it goes on: once the rest is handled, it reaches the last message
    with orders.begin() as conn:
        conn.execute(update(d).where(d.c.group_id == store.gid).values(state="done"))
        store.advance_frontier(conn)
    assert frontier(orders, store.gid)[1] == late


def test_the_upgrade_names_each_groups_space_and_keeps_its_frontier(pg_dsn, schema):
    restore(pg_dsn, schema, 9)
    engine = pgq.connect(pg_dsn, schema=schema)
    try:
        s = f'"{schema}"'
        with engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {s}.topic (name) VALUES ('t')"))
            conn.execute(
                text(
                    f"INSERT INTO {s}.consumer_group (name, topic_id) SELECT 'g', id FROM {s}.topic"
                )
            )
            conn.execute(
                text(
                    f"INSERT INTO {s}.group_state (group_id, committed_xid, committed_id)"
                    f" SELECT id, '7', 41 FROM {s}.consumer_group"
                )
            )
        pgq.migrate(engine)
        gid = store_of(engine, "g", "m").gid
        assert frontier(engine, gid) == (7, 41, system_identifier(engine))
        with engine.begin() as conn:
            store_of(engine, "g", "m").advance_frontier(conn)
        assert frontier(engine, gid)[:2] == (7, 41)  # not started again: same server
    finally:
        engine.dispose()


def waiting_on_a_lock(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.scalar(
                text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            )
        )


def test_a_rebase_and_an_ack_of_rows_it_freezes_do_not_deadlock(orders):
    """The rebase locks the group's row, then the rows it freezes; an ack locks the
    rows it finishes, then the group's row (to count the deleted ones). An ack of
    rows the rebase freezes, queued on the group's row behind the rebase (both
    waiting for a third member's ack to commit), must not deadlock with it."""
    import concurrent.futures

    from pgq.records import Outcome, OutcomeKind

    acker, rebaser = store_of(orders, "billing", "acker"), store_of(orders, "billing", "rebaser")
    with orders.begin() as conn:
        conn.execute(update(gs).where(gs.c.group_id == acker.gid).values(xid_space=42))
    holder = orders.connect()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        holder.begin()
        # a third member's ack holds the group's row (to its commit): it has an xid,
        # so the rows published next are at or above the rebase's xmin
        holder.execute(select(gs.c.group_id).where(gs.c.group_id == acker.gid).with_for_update())
        holder.execute(select(func.pg_current_xact_id()))
        pgq.publish_many(orders, "orders", [{"n": n} for n in range(3)])
        with orders.begin() as conn:
            claimed = acker.claim(conn, 10, 0)
        assert len(claimed) == 3

        def pid_of(conn: Any) -> int:
            return int(conn.scalar(select(func.pg_backend_pid())))

        pids: dict[str, int] = {}

        def rebase() -> None:
            with orders.begin() as conn:
                pids["rebase"] = pid_of(conn)
                rebaser.advance_frontier(conn)

        def ack() -> None:
            with orders.begin() as conn:
                pids["ack"] = pid_of(conn)
                acker.record(conn, [Outcome(c, OutcomeKind.DONE) for c in claimed])

        rebasing = pool.submit(rebase)
        wait_until(lambda: "rebase" in pids and waiting_on_a_lock(orders, pids["rebase"]), 10)
        acking = pool.submit(ack)
        wait_until(lambda: "ack" in pids and waiting_on_a_lock(orders, pids["ack"]), 10)
        holder.commit()
        errors = []
        for done in (rebasing, acking):
            try:
                done.result(timeout=30)
            except Exception as e:
                errors.append(repr(e).splitlines()[0])
        assert errors == [], errors
    finally:
        holder.close()
        pool.shutdown(wait=True)


def test_a_drained_groups_frontier_stays_at_its_last_message_when_its_rows_move(orders):
    """At rest a group has no rows (the frontier pruned them) and `committed` is its
    last message. Its shard moved (here: its frontier named in another space), the
    rebase must not leave `committed` at nothing until the next message is handled."""
    ids = pgq.publish_many(orders, "orders", [{"n": n} for n in range(3)])
    pgq.Consumer(orders, "billing", lambda msg: None, **FAST).run(until_empty=True)
    store = store_of(orders, "billing", "m")
    with orders.begin() as conn:
        store.advance_frontier(conn)
    assert pgq.status(orders, "billing")["committed"] == ids[-1]
    with orders.begin() as conn:
        conn.execute(update(gs).where(gs.c.group_id == store.gid).values(xid_space=42))

    with orders.begin() as conn:
        store.advance_frontier(conn)

    assert frontier(orders, store.gid)[2] == system_identifier(orders)
    assert pgq.status(orders, "billing")["committed"] == ids[-1]


def test_a_rebase_keeps_the_order_of_a_keys_messages(orders):
    """An ordered group delivers a key's messages in (xid, id) order (decision 0044).
    A rebase that froze only the rows at or above its snapshot's xmin split a key:
    with a transaction open from between two publishes of it, the later message was
    frozen (xid 2) and the earlier one kept its xid, so the later one came first.
    (Every group's first advance was such a rebase before its space was named at
    subscribe; a shard move gives the same split.)"""
    pgq.subscribe(orders, "ledger", "orders", ordered=True)
    store = store_of(orders, "ledger", "m")
    first = pgq.publish(orders, "orders", {"n": 1}, key="k")
    with orders.connect() as conn:
        xid = conn.scalar(select(cast(d.c.xid, Text)).where(d.c.group_id == store.gid))

    def first_is_behind_every_open_transaction() -> bool:
        with orders.connect() as conn:
            return bool(
                conn.scalar(
                    text("SELECT pg_snapshot_xmin(pg_current_snapshot()) > CAST(:x AS xid8)"),
                    {"x": xid},
                )
            )

    # (other sessions of the server may hold the xmin back for a moment)
    wait_until(first_is_behind_every_open_transaction, 30, "the first publish below the xmin")
    holder = orders.connect()
    try:
        holder.begin()
        holder.execute(select(func.pg_current_xact_id()))  # holds the xmin from here
        second = pgq.publish(orders, "orders", {"n": 2}, key="k")
        with orders.begin() as conn:  # as a shard move leaves it: another server's space
            conn.execute(update(gs).where(gs.c.group_id == store.gid).values(xid_space=42))
        with orders.begin() as conn:
            store.advance_frontier(conn)  # a rebase
    finally:
        holder.rollback()
        holder.close()

    def claimed() -> list[int]:
        with orders.begin() as conn:
            return [c.id for c in store.claim(conn, 10, 0)]

    assert wait_until(claimed, 15, "a claim of the key's first message") == [first]
    assert second > first
