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

from fixtures.released import restore
from helpers import store_of
from sqlalchemy import BigInteger, Engine, Text, cast, select, text, tuple_, update

import pgq
from pgq import schema as t

d, gs = t.delivery, t.group_state

AHEAD = 1_000_000
"""How far ahead of this server the other server's xids were."""


def system_identifier(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT system_identifier FROM pg_control_system()")))


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
