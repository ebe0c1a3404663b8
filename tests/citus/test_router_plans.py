"""Which hot statements Citus runs as router plans (one task, one node) under the
placement of `pgq init --distributed`, and what is still wrong there.

The statements that docs/decisions/0023-citus-placement.md found failing or
spread over several shards are strict xfails: each turns into a failure (XPASS)
the day its rewrite lands, so the marker has to go with it. Needs `PGQ_CITUS_DSN`
(see test_placement.py); skipped without it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import os
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import CITUS_DSN, across_groups, citus_marks, citus_worker_dsn, wait_until
from psycopg import sql
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Executable

import pgq
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import admin, breaker, claim, frontier, members, outcomes, publish, samples, status
from pgq.store import GroupStore, run_once
from pgq.store.admin import purge

pytestmark = citus_marks()

SECOND = dt.timedelta(seconds=1)
_names = itertools.count()


@contextlib.contextmanager
def distributed_schema() -> Iterator[tuple[Engine, int]]:
    """A distributed schema of its own with one topic, one group and five messages;
    the group id. Dropped afterwards."""
    schema = f"pgq_router_{os.getpid()}_{next(_names)}"
    engine = pgq.connect(CITUS_DSN, schema=schema, pool_size=2)
    try:
        pgq.migrate(engine, distributed=True)
        pgq.create_topic(engine, "orders")
        pgq.subscribe(engine, "billing", "orders")
        pgq.publish_many(engine, "orders", [{"n": i} for i in range(5)])
        with engine.connect() as conn:
            gid = conn.scalar(text(f'SELECT id FROM "{schema}".consumer_group'))
        yield engine, int(gid)
    finally:
        engine.dispose()
        with psycopg.connect(CITUS_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Engine, int]]:
    """The distributed schema the plan tests share (they change no row, or put back
    what they change)."""
    with distributed_schema() as made:
        yield made


def plan(engine: Engine, stmt: Executable, params: dict[str, Any]) -> list[str]:
    """`EXPLAIN (COSTS OFF)` of `stmt` on `engine`'s schema with `params`."""
    schema = engine.get_execution_options()["schema_translate_map"][SCHEMA_PLACEHOLDER]
    with engine.connect() as conn:
        compiled = stmt.compile(
            dialect=conn.dialect,
            schema_translate_map={SCHEMA_PLACEHOLDER: schema},
            render_schema_translate=True,
        )
        result = conn.exec_driver_sql(
            "EXPLAIN (COSTS OFF) " + str(compiled), compiled.construct_params(params)
        )
        lines = [row[0] for row in result]
        conn.rollback()
    return lines


def tasks(lines: list[str]) -> list[int]:
    """The `Task Count` of each Citus scan in a plan."""
    return [int(m.group(1)) for line in lines if (m := re.search(r"Task Count: (\d+)", line))]


def subplan_scans(lines: list[str]) -> list[str]:
    """What each distributed subplan of a plan scans (the line after its header)."""
    pairs = itertools.pairwise(lines)
    return [after.strip() for line, after in pairs if "Distributed Subplan" in line]


def is_router(lines: list[str]) -> bool:
    """One Citus task and no distributed subplan: the statement runs on one node."""
    return tasks(lines) == [1] and not subplan_scans(lines)


def one_task_each(lines: list[str]) -> bool:
    """Distributed subplans and the final query, each one task: every step runs on the
    group's node, the coordinator passing the rows between them."""
    return bool(subplan_scans(lines)) and set(tasks(lines)) == {1}


HISTORY_WRITERS = frozenset({"record_failures", "sweep_expired", "reconcile_batch"})
"""The statements that write a message's history (decision 0046): Citus plans an
`INSERT ... SELECT` in a CTE as subplans, each one task on the group's node (a round
trip per step, on the failure path, the sweep and the close only)."""


FENCE = {"member": "m1", "ids": [1, 2], "seqs": [7, 8]}
CLAIM = {"member": "m1", "lease": 30 * SECOND, "token": -(5 << 20)}
PRESENT = {"present_gids": [1], "present_names": ["m1"]}
DRAIN = {"member": "m1", "ttl": 30 * SECOND, "wait": SECOND, **PRESENT}
JOIN = {"member": "m1", "host": "h", "pid": 1, "ttl": 30 * SECOND, "takeover": False}
PROBE = {"at_epoch": 1, "max_refunds": 3}


def _xfail(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"0023: {reason}")


STATEMENTS = [
    pytest.param("ack_done", outcomes.ack_done, FENCE, id="ack"),
    pytest.param("extend_leases", claim.extend_leases, {**FENCE, "lease": 30 * SECOND}, id="lease"),
    pytest.param("release", claim.release, FENCE, id="release"),
    pytest.param("settled", outcomes.settled, FENCE, id="settled"),
    pytest.param("state", breaker.state, {}, id="breaker-state"),
    pytest.param(
        "reconcile_done",
        breaker.reconcile_done,
        {"from_epoch": 0, "close_epoch": 2, "max_refunds": 3},
        id="reconcile-done",
    ),
    pytest.param("claim", lambda: claim.claim(100, bodies=False), CLAIM, id="claim"),
    pytest.param(
        "claim_probe",
        lambda: breaker.claim_probe("dead", True, bodies=False),
        {**CLAIM, **PROBE},
        id="claim-probe",
    ),
    pytest.param("message_bodies", claim.message_bodies, {"ids": [1, 2]}, id="bodies"),
    pytest.param("dedupe_lookup", publish.dedupe_lookup, {"keys": ["k"]}, id="dedupe-lookup"),
    pytest.param(
        "record_failures",
        outcomes.record_failures,
        {
            **FENCE,
            "states": ["ready", "dead"],
            "charges": [1, 1],
            "delays": [1.0, 0.0],
            "classes": ["systemic", "message"],
            "errors": ["x", "y"],
            "epochs": [0, 0],
            "seconds": [0.1, None],
        },
        id="fail",
    ),
    pytest.param(
        "heartbeat",
        members.heartbeat,
        {
            "member": "m1",
            "started": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
            "local": "closed",
            "tripped_epoch": None,
        },
        id="heartbeat",
    ),
    pytest.param("join_new", members.join_new, JOIN, id="join-new"),
    pytest.param("join_existing", members.join_existing, JOIN, id="join-existing"),
    pytest.param(
        "sweep_expired", claim.sweep_expired, {"limit": 100, "max_reclaims": 3}, id="sweep"
    ),
    pytest.param("drain_state", members.drain_state, DRAIN, id="drain"),
    pytest.param(
        "forget_departed",
        members.forget_departed,
        {"after": 30 * SECOND, **PRESENT},
        id="forget",
    ),
    pytest.param("advance_frontier", frontier.advance_frontier, {}, id="frontier"),
    pytest.param("prune_behind", frontier.prune_behind, {}, id="prune-behind"),
    pytest.param(
        "add_to_total", lambda: claim.add_to_total("released_total"), {"n": 1}, id="total"
    ),
    pytest.param("check_group", admin.check_group, {}, id="check"),
    pytest.param(
        "expired_candidates",
        frontier.expired_candidates,
        {"topic_id": 1, "retention": SECOND, "limit": 100, "after": 0},
        id="retention-candidates",
    ),
    pytest.param("held_by_group", frontier.held_by_group, {"ids": [1, 2]}, id="retention-held"),
    pytest.param(
        "delete_messages",
        frontier.delete_messages,
        {"topic_id": 1, "ids": [1, 2]},
        id="retention-delete",
    ),
    pytest.param(
        "reconcile_batch",
        breaker.reconcile_batch,
        {"limit": 100, "from_epoch": 0, "close_epoch": 2, "max_refunds": 3, "member": "m1"},
        # one task today, but a wrong one: see the replica test below
        id="reconcile",
    ),
    # the charts' samples (decision 0045): a member's or the dashboard's, per group
    pytest.param("due_sample", samples.due_sample, {}, id="sample-due"),
    pytest.param(
        "write_sample",
        samples.write_sample,
        {
            "at": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
            "done": 1,
            "lag": 2,
            "dead": 0,
            "oldest_ready_age_s": None,
        },
        id="sample-write",
    ),
    pytest.param("group_samples", samples.group_samples, {"span": 3600 * SECOND}, id="samples"),
    pytest.param(
        "delete_expired_samples",
        samples.delete_expired_samples,
        {"keep": 86400 * SECOND},
        id="samples-expire",
    ),
]


@pytest.mark.parametrize("name, statement, params", STATEMENTS)
def test_hot_statement_is_a_router_plan(
    cluster: tuple[Engine, int], name: str, statement: Any, params: dict[str, Any]
):
    engine, gid = cluster
    by_topic = name in ("message_bodies", "dedupe_lookup")
    topic = {"topic_id": topic_of(engine)} if by_topic else {}
    lines = plan(engine, statement(), {"gid": gid, **topic, **params})
    routed = one_task_each(lines) if name in HISTORY_WRITERS else is_router(lines)
    assert routed, "\n".join(lines)


def test_the_oldest_ready_row_is_read_on_the_groups_shard(cluster: tuple[Engine, int]):
    """`status` reads it once per group (decision 0030): one task on the group's node."""
    engine, gid = cluster
    lines = plan(engine, status.oldest_ready(), {"group_id": gid})
    assert is_router(lines), "\n".join(lines)


def topic_of(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text(f'SELECT id FROM "{schema_of(engine)}".topic')))


@pytest.mark.parametrize("purpose", ["", "prober"])
def test_the_lock_test_runs_on_the_coordinator(cluster: tuple[Engine, int], purpose: str):
    """Liveness and the prober's name are read from `pg_locks` by a statement over no
    table of pgq's (0023, 3.1): planned on the coordinator, where members hold their
    locks, not on the group's worker."""
    engine, gid = cluster
    params = {"gids": [gid], "names": ["m1"], "table": f'"{schema_of(engine)}".member'}
    lines = plan(engine, members.holding(purpose), params)
    assert tasks(lines) == [] and not any("Citus" in line for line in lines), "\n".join(lines)


def test_a_member_claims_on_the_cluster_with_its_messages():
    """The claim on the cluster (0023, section 4): the rows are leased on the group's
    shard under the member's token (negative, decision 0004), the messages read on
    the topic's shard by a second statement, and a row claimed again gets a new token.
    Joined in one statement, as on one server, Citus refuses it."""
    with distributed_schema() as (engine, gid):
        store = GroupStore(gid, "billing", "orders", "m1", 30.0, 3, topic_id=topic_of(engine))
        first = run_once(engine, store.claim, 2, 0)
        assert [(c.id, c.message.payload) for c in first] == [(1, {"n": 0}), (2, {"n": 1})]
        assert first[0].seq == first[1].seq < 0
        assert run_once(engine, store.release, [first[0].lease]) == {first[0].lease}
        [again] = run_once(engine, store.claim, 1, 0)
        assert again.id == 1 and again.seq not in (0, first[0].seq)
        with pytest.raises(DBAPIError, match="complex joins are only supported"):
            with engine.begin() as conn:
                conn.execute(claim.claim(2), {"gid": gid, **CLAIM})


def schema_of(engine: Engine) -> str:
    return engine.get_execution_options()["schema_translate_map"][SCHEMA_PLACEHOLDER]


def test_failures_run_each_due_after_its_own_delay(cluster: tuple[Engine, int]):
    """`EXPLAIN` only plans the failure statement; this runs it on the cluster (the
    claim cannot run there yet, so the rows are leased by hand)."""
    engine, gid = cluster
    schema = engine.get_execution_options()["schema_translate_map"][SCHEMA_PLACEHOLDER]
    with engine.begin() as conn:
        leased = conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'leased', lease_owner = 'm1',"
                " lease_seq = message_id + 1000, lease_expires_at = now() + interval '1 min'"
                " WHERE group_id = :gid AND message_id IN (4, 5) RETURNING message_id, lease_seq"
            ),
            {"gid": gid},
        ).all()
    (a, seq_a), (b, seq_b) = sorted(leased)
    params = {
        "gid": gid,
        "member": "m1",
        "ids": [b, a],
        "seqs": [seq_b, seq_a],
        "states": ["ready", "dead"],
        "charges": [1, 1],
        "delays": [90.5, 0.0],
        "classes": ["systemic", "message"],
        "errors": ["x", "y"],
        "epochs": [0, 0],
        "seconds": [None, None],
    }
    try:
        with engine.begin() as conn:
            applied = conn.execute(outcomes.record_failures(), params).all()
            found = conn.execute(
                text(
                    f"SELECT message_id, state, available_at - updated_at AS delay"
                    f' FROM "{schema}".delivery WHERE group_id = :gid AND message_id IN (4, 5)'
                ),
                {"gid": gid},
            ).all()
        assert sorted(applied) == sorted(leased)
        assert sorted(found) == [(a, "dead", dt.timedelta(0)), (b, "ready", 90.5 * SECOND)]
    finally:
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"UPDATE \"{schema}\".delivery SET state = 'ready', available_at = now(),"
                    " attempts = 0, error_class = NULL, last_error = NULL, lease_owner = NULL,"
                    " lease_expires_at = NULL WHERE group_id = :gid"
                ),
                {"gid": gid},
            )


def test_joins_run_and_refuse_a_name_heard_from(cluster: tuple[Engine, int]):
    """The two statements of a join run on the cluster: a new name joins, a second
    process under it is refused, the holder of its session lock takes it over."""
    engine, gid = cluster

    def join(takeover: bool) -> Any:
        store = GroupStore(gid, "billing", "orders", "join-test", 30.0, 3)
        return store.started if run_once(engine, store.join, 30.0, takeover) else None

    first = join(takeover=False)
    assert first is not None
    assert join(takeover=False) is None
    again = join(takeover=True)
    assert again is not None and again > first


def test_a_purge_runs_audited_and_counts_the_rows_it_keeps():
    """The purge, its audit row and the count of the dead rows a coming
    reconciliation will bring back, in one statement on the cluster (the count
    used to fail there: 0023, section 2)."""
    with distributed_schema() as (engine, gid):
        schema = engine.get_execution_options()["schema_translate_map"][SCHEMA_PLACEHOLDER]
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = 1"
                    " WHERE group_id = :gid"
                ),
                {"gid": gid},
            )
            conn.execute(
                text(
                    f"UPDATE \"{schema}\".delivery SET state = 'dead', error_class = CASE"
                    " WHEN message_id <= 2 THEN 'systemic' ELSE 'message' END, error_epoch = 1,"
                    " refundable_attempts = CASE WHEN message_id <= 2 THEN 1 ELSE 0 END"
                    " WHERE group_id = :gid AND message_id <= 4"
                ),
                {"gid": gid},
            )
        result = purge(engine, "billing", reason="citus")
        assert (result.count, result.kept) == (2, 2)
        with across_groups(engine) as conn:  # every group's
            left = conn.execute(
                text(f'SELECT message_id, state FROM "{schema}".delivery ORDER BY 1')
            ).all()
            audited = conn.execute(
                text(f'SELECT action, message_ids, count, reason FROM "{schema}".audit')
            ).all()
        assert left == [(1, "dead"), (2, "dead"), (5, "ready")]
        assert audited == [("purge", [3, 4], 2, "citus")]


def test_reconciliation_keeps_the_reference_replicas_equal(cluster: tuple[Engine, int]):
    """The refund count is written on the group's shard (`group_state`), not into a
    reference table from a statement routed to one of its replicas (0023 3.3: one
    replica of `consumer_group` said 2 refunds, the others 0)."""
    engine, gid = cluster
    schema = engine.get_execution_options()["schema_translate_map"][SCHEMA_PLACEHOLDER]
    state = f'"{schema}".group_state'
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'dead', error_class = 'systemic',"
                " error_epoch = 0, refundable_attempts = 1 WHERE group_id = :gid"
            ),
            {"gid": gid},
        )
        before = conn.scalar(
            text(f"SELECT refunded_total FROM {state} WHERE group_id = :gid"), {"gid": gid}
        )
    params = {"gid": gid, "limit": 100, "from_epoch": 0, "close_epoch": 2, "max_refunds": 3}
    with engine.begin() as conn:
        conn.execute(breaker.reconcile_batch(), {**params, "member": "m1"})
        after = conn.scalar(
            text(f"SELECT refunded_total FROM {state} WHERE group_id = :gid"), {"gid": gid}
        )
        conn.execute(
            text(f"UPDATE {state} SET refunded_total = :n WHERE group_id = :gid"),
            {"n": before, "gid": gid},
        )
    assert after == before + 5  # every row of the group, counted on its shard
    with psycopg.connect(CITUS_DSN) as conn:
        replicas = conn.execute(
            "SELECT nodeport, result FROM run_command_on_placements(%s,"
            " 'SELECT md5(string_agg(g::text, '','' ORDER BY id)) FROM %%s g')",
            [f'"{schema}".consumer_group'],
        ).fetchall()
    assert len(replicas) == 3 and len({result for _, result in replicas}) == 1, replicas


def test_a_member_holding_its_lock_is_live_on_the_cluster():
    """Liveness on the cluster (0023, 3.1): a member whose session holds its lock (on
    the coordinator) is live for the drain check and for status; once the lock's
    session is gone, its leases count as held by a dead member. Before liveness was
    a parameter, the test ran on the worker and every member looked dead."""
    from pgq.store.connections import member_lock
    from pgq.store.members import lock_holders

    with distributed_schema() as (engine, gid):
        store = GroupStore(gid, "billing", "orders", "m1", 30.0, 3, topic_id=topic_of(engine))
        session = member_lock(engine, gid, "m1")
        assert session.acquire()
        try:
            assert run_once(engine, store.join, 30.0, True)
            run_once(engine, store.claim, 2, 0)
            with engine.connect() as conn:
                holders = lock_holders(conn, gid, "")
            assert (holders["present_gids"], holders["present_names"]) == ([gid], ["m1"])
            other = GroupStore(gid, "billing", "orders", "m2", 30.0, 3)
            assert run_once(engine, other.drain_state, 30.0).held == 0  # m1 is live
            [member] = pgq.status(engine, "billing")["members"]
            assert (member["name"], member["live"]) == ("m1", True)
        finally:
            session.release()
        assert run_once(engine, other.drain_state, 30.0).held == 2  # m1 is gone


def test_show_reads_a_message_and_its_row_on_the_cluster():
    """`pgq show` on the cluster (0023, section 2: it failed, joining `message` and
    `delivery`): the message from the topic's shard, the group's row from the
    group's, each a router plan; a row its ack deleted, then the frontier passed,
    shows as done."""
    from pgq import monitor
    from pgq.sql import admin

    with distributed_schema() as (engine, gid):
        params = {"topic_id": topic_of(engine), "mid": 1}
        assert is_router(plan(engine, admin.message_of_topic(), params))
        in_group = {"gid": gid, "mid": 1, "message_xid": None, "message_created_at": None}
        lines = plan(engine, admin.message_in_group(), in_group)
        assert is_router(lines), "\n".join(lines)
        shown = monitor.message(engine, "billing", 1)
        assert (shown["row"], shown["state"], shown["payload"]) == ("present", "ready", {"n": 0})
        store = GroupStore(gid, "billing", "orders", "m1", 30.0, 3)
        claimed = run_once(engine, store.claim, 5, 0)
        from pgq.records import Outcome

        run_once(engine, store.record, [Outcome(c, "done") for c in claimed])

        def advanced() -> bool:  # another test's transaction on the worker may hold it a while
            run_once(engine, store.advance_frontier)
            return bool(monitor.message(engine, "billing", 1)["behind_frontier"])

        wait_until(advanced, 30, "the frontier did not pass message 1")
        pruned = monitor.message(engine, "billing", 1)
        assert (pruned["row"], pruned["state"], pruned["behind_frontier"]) == (
            "pruned",
            "done",
            True,
        )


def test_status_names_what_holds_each_groups_frontier_on_its_worker():
    """A group's frontier is computed on the worker of its shard, in that node's xids
    (0023, section 5): `frontier_held_by` names the oldest transaction there, not
    the coordinator's, nor the status read's own backends on the workers."""
    from pgq import monitor
    from pgq.store.placement import nodes_of

    with distributed_schema() as (engine, gid):
        pgq.subscribe(engine, "audit", "orders")
        with engine.connect() as conn:
            delivery = f'"{schema_of(engine)}".delivery'
            gids = [gid, gid + 1]
            nodes = {gid: port for gid, (_, port) in nodes_of(conn, delivery, gids).items()}
        holders = {}
        for port in sorted(set(nodes.values())):
            worker = psycopg.connect(citus_worker_dsn(port))
            worker.execute("SELECT pg_current_xact_id()")
            holders[port] = worker
        try:
            groups = {g["group"]: g for g in monitor.status_all(engine, member_ttl=30)["groups"]}
            for name, group_id in (("billing", gid), ("audit", gid + 1)):
                held = groups[name]["frontier_held_by"]
                assert held is not None and held["pid"] == holders[nodes[group_id]].info.backend_pid
        finally:
            for worker in holders.values():
                worker.close()


def test_a_deduplicated_publish_writes_its_messages_on_the_topics_one_shard():
    """Idempotent publish on the cluster (decision 0040): the unique index of (topic,
    dedupe key) is on every shard of `message` (valid there: it holds the distribution
    column); the insert with its `ON CONFLICT` goes to the topic's one shard, and the
    lookup of a key already there is one task on that shard too. A key published
    again is one message, one row per group."""
    with distributed_schema() as (engine, gid):
        schema = schema_of(engine)
        first = pgq.publish(engine, "orders", {"n": 1}, dedupe_key="k")
        with engine.connect() as conn:
            remote: list[str] = []
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.add_notice_handler(lambda d: remote.append(d.message_primary or ""))
            conn.execute(text("SET citus.log_remote_commands = on"))
            ids = pgq.publish_many(conn, "orders", [2, 3, 4], dedupe_keys=["k", "j", None])
            conn.commit()
        assert ids[0] == first and len(set(ids)) == 3
        inserts = [c for c in remote if re.search(r"INSERT INTO \S+\.message_\d+ ", c)]
        lookups = [c for c in remote if re.search(r"SELECT dedupe_key, id FROM \S+\.message_", c)]
        assert len(inserts) == 1 and "ON CONFLICT" in inserts[0], inserts
        assert len(lookups) == 1, lookups
        shard = re.search(r"message_(\d+)", inserts[0])
        assert shard is not None and f"message_{shard.group(1)} " in lookups[0]
        with psycopg.connect(CITUS_DSN) as conn:
            shards = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE result LIKE %s) FROM"
                " run_command_on_shards(%s, $$SELECT indexdef FROM pg_indexes"
                " WHERE indexname LIKE 'message_dedupe_key_idx%%%%'"
                " AND tablename = split_part('%%s', '.', 2)$$)",
                [
                    "%UNIQUE%(topic_id, dedupe_key)%WHERE (dedupe_key IS NOT NULL)%",
                    f'"{schema}".message',
                ],
            ).fetchone()
        assert shards is not None and shards[0] > 1 and shards[0] == shards[1], shards
        with engine.connect() as conn:
            rows = conn.execute(
                text(f'SELECT message_id, count(*) FROM "{schema}".delivery'
                     " WHERE group_id = :gid GROUP BY 1 HAVING count(*) > 1"), {"gid": gid}
            ).all()  # fmt: skip
        assert rows == []
