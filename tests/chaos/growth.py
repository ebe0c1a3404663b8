"""A Citus cluster changed under a running history run: a busy group's shard moved to
the other worker, or a node added and the cluster rebalanced (issue 24, decision 0047).

Both as a user does them, with Citus's own functions on the coordinator, while the
members, publishers and faults of `tests/chaos/test_topics.py` go on. A move makes
the node the shard leaves run ahead of the node it goes to in xids first, so that the
moved rows' xids are above the new node's: the case where a frontier that kept the
old node's positions would stall and let new rows fall behind it. A node added is
fresh, behind every worker in xids.
"""

from __future__ import annotations

import psycopg
from psycopg.conninfo import make_conninfo
from sqlalchemy import Engine, text

from pgq.store import group_info
from pgq.store.engine import schema_of

AHEAD = 3000
"""Transactions the node a shard leaves runs ahead of the node it goes to, at least."""


def next_xids(engine: Engine) -> dict[tuple[str, int], int]:
    """Each active worker's next transaction id."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT nodename, nodeport, result FROM pg_catalog.run_command_on_workers("
                "'SELECT pg_snapshot_xmax(pg_current_snapshot())')"
            )
        ).all()
    return {(row.nodename, int(row.nodeport)): int(row.result) for row in rows}


def burn_xids(dsn: str, node: tuple[str, int], count: int) -> None:
    """Run `count` transactions that take an xid on `node`, directly (as the user and
    database of `dsn`, the coordinator's)."""
    with psycopg.connect(
        make_conninfo(dsn, host=node[0], port=str(node[1])), autocommit=True
    ) as conn:
        conn.execute(
            f"DO $$BEGIN FOR i IN 1..{int(count)} LOOP"
            " PERFORM pg_current_xact_id(); COMMIT; END LOOP; END$$"
        )


def shard_of(engine: Engine, group: str) -> tuple[int, tuple[str, int]]:
    """The shard of `group`'s delivery rows and the node that holds it."""
    table = f'"{schema_of(engine)}".delivery'
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT s.shardid, s.nodename, s.nodeport FROM pg_catalog.citus_shards s"
                " WHERE s.shardid = pg_catalog.get_shard_id_for_distribution_column("
                "CAST(:table AS regclass), :gid)"
            ),
            {"table": table, "gid": group_info(engine, group).id},
        ).one()
    return int(row.shardid), (row.nodename, int(row.nodeport))


def move_group_shard(engine: Engine, dsn: str, group: str) -> str:
    """Move `group`'s shard (with its co-located shards) to another worker, the node it
    leaves made to run at least `AHEAD` xids ahead of the one it goes to first."""
    shard, source = shard_of(engine, group)
    xids = next_xids(engine)
    target = next(node for node in xids if node != source)
    burn_xids(dsn, source, max(0, xids[target] - xids[source]) + AHEAD)
    xids = next_xids(engine)
    with engine.connect() as conn:
        conn.execute(
            text("SELECT pg_catalog.citus_move_shard_placement(:shard, :sh, :sp, :th, :tp)"),
            {"shard": shard, "sh": source[0], "sp": source[1], "th": target[0], "tp": target[1]},
        )
        conn.commit()
    moved_to = shard_of(engine, group)[1]
    assert moved_to == target, f"shard {shard} is on {moved_to}, not {target}"
    return (
        f"moved shard {shard} of {group} from :{source[1]} (next xid {xids[source]})"
        f" to :{target[1]} (next xid {xids[target]})"
    )


def add_node_and_rebalance(engine: Engine, host: str, port: int) -> str:
    """Add the node at `host:port` and rebalance the cluster onto it, waiting for the
    rebalance to finish."""
    with engine.connect() as conn:
        node = {"host": host, "port": port}
        conn.execute(text("SELECT pg_catalog.citus_add_node(:host, :port)"), node)
        conn.commit()
        xids = next_xids(engine)
        conn.execute(text("SELECT pg_catalog.citus_rebalance_start()"))
        conn.commit()
        conn.execute(text("SELECT pg_catalog.citus_rebalance_wait()"))
        conn.commit()
        placed = conn.scalar(
            text(
                "SELECT count(*) FROM pg_catalog.citus_shards"
                " WHERE nodename = :host AND nodeport = :port"
            ),
            node,
        )
    others = ", ".join(f":{p} {x}" for (_, p), x in sorted(xids.items()) if p != port)
    return (
        f"added :{port} (next xid {xids.get((host, port))}; others {others}) and rebalanced:"
        f" {placed} shards moved to it"
    )
