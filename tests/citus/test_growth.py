"""A Citus cluster that grows while pgq runs on it: a busy group's shard moved, a node
added and the cluster rebalanced, under the history run (issue 24, decision 0047).

Each test runs `tests/chaos/test_topics.py` in a child pytest on a cluster of its own
(coordinator + 2 workers, `wal_level = logical` so that Citus moves shards without
blocking writes, as it does by default; plus a spare node for the rebalance),
started with `../shared/citus/cluster.sh` on free ports and removed afterwards: the
shared cluster's placement is left alone. Two topics × three groups, concurrent
publishers, retention, `kill -9` and connection cuts every cycle, the frontier
watch; a third into the run the cluster changes (`tests/chaos/growth.py`). Then
the checker: nothing lost, no orphans, every duplicate explained by a fault, no
frontier past an unresolved row or moved back within its xid space.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from chaos.growth import burn_xids, next_xids, shard_of
from helpers import citus_marks, store_of, strict_dsn
from psycopg import sql as psql
from sqlalchemy import Engine, text

import pgq
from pgq.store.engine import schema_of

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("PGQ_CITUS_TOOLS", ROOT.parent / "shared" / "citus"))
"""`../shared/citus` beside the repository (as `.ci/run` finds it), or where this says."""
CLUSTER_SH = TOOLS / "cluster.sh"
SECONDS = 40
"""How long each history run's chaos lasts."""

pytestmark = [
    *citus_marks(),
    pytest.mark.slow,
    pytest.mark.skipif(not CLUSTER_SH.exists(), reason=f"no {CLUSTER_SH} to start a cluster"),
    pytest.mark.skipif(os.geteuid() != 0, reason="cluster.sh starts servers as root"),
]


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Cluster:
    dsn: str
    spare: int


def cluster_sh(command: str, ports: list[int], directory: Path) -> None:
    env = {
        **os.environ,
        "CITUS_PORTS": " ".join(map(str, ports)),
        "CITUS_CLUSTER_DIR": str(directory),
        # 4 shards per table: a rebalance onto a third node moves a few shard groups,
        # not dozens (each a logical-replication move, seconds on this machine)
        "CITUS_EXTRA_CONF": "fsync=off\nwal_level=logical\ncitus.shard_count=4",
    }
    done = subprocess.run(
        ["bash", str(CLUSTER_SH), command], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"cluster.sh {command} {ports}:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A coordinator and two workers, and a spare node with Citus, all of their own
    (in a directory the servers' user can reach: pytest's own is root's alone)."""
    ports = free_ports(4)
    base = Path(tempfile.mkdtemp(prefix="pgq-growth-"))
    base.chmod(0o755)
    main, spare = (ports[:3], base / "cluster"), (ports[3:], base / "spare")
    try:
        cluster_sh("start", *main)
        cluster_sh("start", *spare)
        yield Cluster(f"postgresql://postgres@127.0.0.1:{ports[0]}/postgres", ports[3])
    finally:
        for ports_, directory in (main, spare):
            cluster_sh("remove", ports_, directory)
        shutil.rmtree(base, ignore_errors=True)


# -- a shard moved while no member runs ------------------------------------------------
# (members down for a deploy while the cluster is rebalanced and a node drained, say):
# moved from A to B and back to A before any member advanced the group on B, the rows
# published meanwhile have B's xids, under a frontier that still looks like A's when
# the space is the node alone; the shard is a new table on A, so it is not.


@pytest.fixture
def moving(cluster: Cluster) -> Iterator[Engine]:
    schema = f"pgq_moves_{os.getpid()}"
    engine = pgq.connect(strict_dsn(cluster.dsn), schema=schema)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "t")
        pgq.subscribe(engine, "g", "t")
        yield engine
    finally:
        engine.dispose()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(
                psql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(psql.Identifier(schema))
            )


def move(engine: Engine, to: tuple[str, int]) -> None:
    shard, source = shard_of(engine, "g")
    with engine.connect() as conn:
        conn.execute(
            text("SELECT pg_catalog.citus_move_shard_placement(:s, :sh, :sp, :th, :tp)"),
            {"s": shard, "sh": source[0], "sp": source[1], "th": to[0], "tp": to[1]},
        )
        conn.commit()
    assert shard_of(engine, "g")[1] == to


def unresolved_behind(engine: Engine, gid: int) -> list[tuple[int, str, str]]:
    """Ready or leased rows at or behind the frontier, when it counts in the space of
    the node that holds the group (one routed statement: that node's snapshot)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT d.message_id, d.state::text, d.xid::text"
                " FROM {s}.delivery d JOIN {s}.group_state f ON f.group_id = d.group_id"
                " WHERE d.group_id = :gid AND f.group_id = :gid"
                " AND d.state IN ('ready', 'leased')"
                " AND f.xid_space ="
                " (pg_catalog.pg_control_system()).system_identifier # f.tableoid::bigint"
                " AND (d.xid, d.message_id) <= (f.committed_xid, f.committed_id)"
                " ORDER BY d.message_id".replace("{s}", f'"{schema_name(engine)}"')
            ),
            {"gid": gid},
        ).all()
    return [(int(r[0]), r[1], r[2]) for r in rows]


def schema_name(engine: Engine) -> str:
    return schema_of(engine)


def drain(engine: Engine) -> None:
    pgq.Consumer(engine, "g", lambda msg: None, poll_interval=0.1).run(until_empty=True)


def test_a_shard_moved_away_and_back_before_any_advance_keeps_its_promise(
    moving: Engine, cluster: Cluster
) -> None:
    store = store_of(moving, "g", "m")
    a = shard_of(moving, "g")[1]
    b = next(node for node in next_xids(moving) if node != a)
    xids = next_xids(moving)
    burn_xids(cluster.dsn, a, max(0, xids[b] - xids[a]) + 3000)  # A ahead of B
    pgq.publish_many(moving, "t", [{"n": n} for n in range(3)])
    drain(moving)
    with moving.begin() as conn:
        store.advance_frontier(conn)  # the frontier in A's space, at the third message

    move(moving, b)  # no member runs: nothing advances the group on B
    late = pgq.publish_many(moving, "t", [{"n": f"on B {n}"} for n in range(2)])  # B's xids
    move(moving, a)
    with moving.begin() as conn:
        store.advance_frontier(conn)

    # the frontier is in A's space again, and promises the rows written on B resolved
    assert unresolved_behind(moving, store.gid) == []
    drain(moving)
    with moving.begin() as conn:
        store.advance_frontier(conn)
    assert pgq.status(moving, "g")["committed"] == late[-1]


def history_run(cluster: Cluster, growth: str, tmp_path: Path) -> str:
    """The history run on `cluster`, changed as `growth` says; its report."""
    report = tmp_path / "report.txt"
    env = {k: v for k, v in os.environ.items() if k != "PGQ_CITUS_DSN"}
    env.update(
        PGQ_TEST_DSN=cluster.dsn,
        PGQ_TEST_DISTRIBUTED="1",
        CHAOSQ_TOPICS_SECONDS=str(SECONDS),
        CHAOSQ_GROWTH=growth,
        CHAOSQ_REPORT=str(report),
        COLUMNS="240",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*cmd, "tests/chaos/test_topics.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SECONDS * 1.3 + 400,
    )
    text = report.read_text() if report.exists() else ""
    assert done.returncode == 0, f"exit {done.returncode}:\n{text}\n{done.stdout[-6000:]}"
    print(text)  # the checker's report, for `pytest -s` (docs/scaling.md quotes one)
    return text


@pytest.mark.timeout(SECONDS * 1.3 + 450)
def test_a_busy_groups_shard_moves_to_a_node_behind_in_xids_under_load(
    cluster: Cluster, tmp_path: Path
) -> None:
    report = history_run(cluster, "move", tmp_path)
    assert "growth: moved shard" in report, report
    # the moved group's frontier started again in the new node's xids, and went on
    assert "'taa': 1" in report.split("started again in a new xid space")[1].splitlines()[0]


@pytest.mark.timeout(SECONDS * 1.3 + 450)
def test_a_node_is_added_and_the_cluster_rebalanced_under_load(
    cluster: Cluster, tmp_path: Path
) -> None:
    report = history_run(cluster, f"add:127.0.0.1:{cluster.spare}", tmp_path)
    assert f"growth: added :{cluster.spare}" in report, report
    assert " 0 shards moved" not in report, report
