"""pgq on Citus: `pgq init --distributed` places the tables as
docs/decisions/0023-citus-placement.md says.

Runs against a real Citus coordinator named by `PGQ_CITUS_DSN`, e.g. the cluster
`../shared/citus/cluster.sh start` runs (postgresql://postgres@127.0.0.1:9701/postgres);
skipped without it. Each test works in a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from fixtures.released import restore
from helpers import (
    CITUS_DSN,
    STRICT_CITUS_DSN,
    across_groups,
    citus_marks,
    citus_owner,
    invoke,
    store_of,
)
from psycopg import sql
from sqlalchemy import select

import pgq
from pgq import schema as t
from pgq.errors import UsageError
from pgq.sql import frontier as frontier_sql
from pgq.sql import placement as place
from pgq.store import LATEST

pytestmark = citus_marks()

BY_GROUP = tuple(table.name for table in place.BY_GROUP)
REFERENCE = ("schema_version", "topic", "consumer_group")

_names = itertools.count()


@pytest.fixture
def citus_schema() -> Iterator[str]:
    """A fresh schema name on the coordinator (dropped afterwards, on every node)."""
    name = f"pgq_citus_{os.getpid()}_{next(_names)}"
    yield name
    with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def placement(schema: str) -> dict[str, dict[str, Any]]:
    """Every table of `schema` with how Citus places it (`kind` None: not in Citus at all)."""
    with psycopg.connect(CITUS_DSN) as conn:
        rows = conn.execute(
            """
            SELECT c.relname,
                   CASE WHEN p.partmethod = 'h' THEN 'distributed'
                        WHEN p.partmethod = 'n' AND p.repmodel = 't' THEN 'reference'
                        WHEN p.partmethod IS NOT NULL THEN 'citus local' END AS kind,
                   column_to_column_name(p.logicalrelid, p.partkey) AS column,
                   p.colocationid
            FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            LEFT JOIN pg_dist_partition p ON p.logicalrelid = c.oid
            WHERE n.nspname = %s AND c.relkind = 'r'
            """,
            [schema],
        ).fetchall()
    return {r[0]: {"kind": r[1], "column": r[2], "colocation": r[3]} for r in rows}


def primary_key(schema: str, table: str) -> str:
    with psycopg.connect(CITUS_DSN) as conn:
        row = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = to_regclass(%s) AND contype = 'p'",
            [f"{schema}.{table}"],
        ).fetchone()
    assert row is not None
    return str(row[0])


def assert_placed(schema: str) -> None:
    placed = placement(schema)
    assert set(placed) == {*BY_GROUP, *REFERENCE, "message"}, placed
    for table in REFERENCE:
        assert placed[table]["kind"] == "reference", (table, placed[table])
    for table in BY_GROUP:
        assert placed[table]["kind"] == "distributed", (table, placed[table])
        assert placed[table]["column"] == "group_id", (table, placed[table])
    assert placed["message"]["kind"] == "distributed"
    assert placed["message"]["column"] == "topic_id"
    # a group's rows of every per-group table on one shard; messages apart
    assert len({placed[table]["colocation"] for table in BY_GROUP}) == 1, placed
    assert placed["message"]["colocation"] != placed["delivery"]["colocation"]
    assert primary_key(schema, "message") == "PRIMARY KEY (topic_id, id)"
    assert primary_key(schema, "audit") == "PRIMARY KEY (group_id, id)"
    # a delivery row's xid is set on its worker (0023, section 5)
    with psycopg.connect(CITUS_DSN) as conn:
        triggers = conn.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal",
            [f"{schema}.delivery"],
        ).fetchall()
    assert triggers == [("delivery_local_xid",)]


def test_init_distributed_places_every_table(citus_schema: str):
    result = invoke({"PGQ_DSN": CITUS_DSN, "PGQ_SCHEMA": citus_schema}, "init", "--distributed")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"schema {citus_schema} at version {LATEST}, distributed"
    assert_placed(citus_schema)


def test_distributing_a_plain_install_keeps_its_rows_and_runs_again(citus_schema: str):
    engine = pgq.connect(CITUS_DSN, schema=citus_schema, pool_size=None)
    try:
        assert pgq.migrate(engine) == LATEST  # a plain install on the coordinator
        assert {p["kind"] for p in placement(citus_schema).values()} == {None}
        pgq.create_topic(engine, "orders")
        pgq.subscribe(engine, "billing", "orders")
        pgq.publish_many(engine, "orders", [{"n": 1}, {"n": 2}])
        assert pgq.migrate(engine, distributed=True) == LATEST
        assert_placed(citus_schema)
        assert pgq.migrate(engine, distributed=True) == LATEST  # nothing left to do
        assert_placed(citus_schema)
        with citus_owner() as conn:  # every topic's and group's rows
            counts = conn.execute(
                sql.SQL(
                    "SELECT (SELECT count(*) FROM {}.message), (SELECT count(*) FROM {}.delivery)"
                ).format(sql.Identifier(citus_schema), sql.Identifier(citus_schema))
            ).fetchone()
        assert counts == (2, 2)
    finally:
        engine.dispose()


def test_concurrent_distributed_inits_agree(citus_schema: str):
    engines = [pgq.connect(CITUS_DSN, schema=citus_schema, pool_size=None) for _ in range(2)]
    results: list[int] = []
    errors: list[BaseException] = []

    def run(engine: Any) -> None:
        try:
            results.append(pgq.migrate(engine, distributed=True))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for engine in engines:
        engine.dispose()
    assert not errors, errors
    assert results == [LATEST, LATEST]
    assert_placed(citus_schema)


def test_distributed_on_a_worker_is_refused(citus_schema: str):
    with psycopg.connect(CITUS_DSN) as conn:
        worker = conn.execute(
            "SELECT nodename, nodeport FROM pg_dist_node WHERE groupid <> 0 AND isactive"
            " ORDER BY nodeport LIMIT 1"
        ).fetchone()
    assert worker is not None, "the cluster has no active worker"
    params = psycopg.conninfo.conninfo_to_dict(CITUS_DSN)
    params.update(host=worker[0], port=str(worker[1]))
    engine = pgq.connect(
        psycopg.conninfo.make_conninfo(**params), schema=citus_schema, pool_size=None
    )
    try:
        with pytest.raises(UsageError, match="this node is a worker"):
            pgq.migrate(engine, distributed=True)
    finally:
        engine.dispose()


def test_a_distributed_version_3_is_upgraded_in_place(citus_schema: str):
    """A schema version 3 placed (no `group_state`, no xid trigger) is upgraded by a
    plain `pgq init`: the group's frontier and totals move to `group_state`, which is
    placed with the group's rows, and delivery rows get their worker's xid."""
    restore(CITUS_DSN, citus_schema, 3)
    s = sql.Identifier(citus_schema)
    with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {}.topic (name) VALUES ('t')").format(s))
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.consumer_group (name, topic_id, committed_id, done_pruned,"
                " refunded_total) SELECT 'g', id, 7, 7, 3 FROM {}.topic"
            ).format(s, s)
        )
        conn.execute(
            sql.SQL("INSERT INTO {}.breaker (group_id) SELECT id FROM {}.consumer_group").format(
                s, s
            )
        )
        # as version 3's `pgq init --distributed` placed it
        for table in REFERENCE:
            conn.execute("SELECT create_reference_table(%s)", [f"{citus_schema}.{table}"])
        for table, key in (("message", "topic_id"), ("audit", "group_id")):
            conn.execute(
                sql.SQL(
                    "ALTER TABLE {}.{} DROP CONSTRAINT {}, ADD CONSTRAINT {} PRIMARY KEY ({}, id)"
                ).format(
                    s,
                    sql.Identifier(table),
                    sql.Identifier(f"{table}_pkey"),
                    sql.Identifier(f"{table}_pkey"),
                    sql.Identifier(key),
                )
            )
        delivery = f"{citus_schema}.delivery"
        conn.execute("SELECT create_distributed_table(%s, 'group_id')", [delivery])
        for table in ("member", "breaker", "breaker_history", "probe", "audit"):  # version 3's
            conn.execute(
                "SELECT create_distributed_table(%s, 'group_id', colocate_with => %s)",
                [f"{citus_schema}.{table}", delivery],
            )
        conn.execute(
            "SELECT create_distributed_table(%s, 'topic_id', colocate_with => 'none')",
            [f"{citus_schema}.message"],
        )
    # the upgrade rewrites every group's rows: one of the named spanning statements
    engine = pgq.connect(STRICT_CITUS_DSN, schema=citus_schema, pool_size=None)
    try:
        assert pgq.migrate(engine) == LATEST
        assert_placed(citus_schema)
        with citus_owner() as conn:  # every group's
            state = conn.execute(
                sql.SQL(
                    "SELECT committed_id, done_pruned, refunded_total FROM {}.group_state"
                ).format(s)
            ).fetchall()
        assert state == [(7, 7, 3)]
    finally:
        engine.dispose()


def test_a_distributed_version_9_names_each_groups_space_with_its_worker(citus_schema: str):
    """Schema version 10 on a placed schema: each existing group's frontier is named
    with the system identifier of the worker that holds its shard (not the
    coordinator's), so that no group's next advance starts its frontier again."""
    engine = pgq.connect(CITUS_DSN, schema=citus_schema, pool_size=None)
    s = sql.Identifier(citus_schema)
    gs = t.group_state
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        for group in ("g1", "g2", "g3", "g4"):
            pgq.subscribe(engine, group, "t")
        with citus_owner(autocommit=True) as conn:  # as version 9 left it
            conn.execute(
                sql.SQL("UPDATE {}.group_state SET committed_xid = '5', committed_id = 3").format(s)
            )
            conn.execute(sql.SQL("ALTER TABLE {}.group_state DROP COLUMN xid_space").format(s))
            conn.execute(sql.SQL("DELETE FROM {}.schema_version WHERE version = 10").format(s))
        assert pgq.migrate(engine) == LATEST
        with across_groups(engine) as conn:  # each group's space, as its node computes it
            here = {
                gid: conn.scalar(
                    select(frontier_sql.SPACE).select_from(gs).where(gs.c.group_id == gid)
                )
                for gid in conn.scalars(select(gs.c.group_id))
            }
            named = dict(conn.execute(select(gs.c.group_id, gs.c.xid_space)).all())
        assert len(named) == 4 and None not in named.values(), named
        assert named == here
        store = store_of(engine, "g1")
        with engine.begin() as conn:
            store.advance_frontier(conn)
        assert pgq.status(engine, "g1")["committed"] == 3  # not started again
    finally:
        engine.dispose()
