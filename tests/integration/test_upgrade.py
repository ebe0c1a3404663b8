"""`pgq init` upgrades a database in use, built by an earlier version, and it drains.

`tests/fixtures/schemas/v<N>.sql` is the schema each earlier version created as
released (`fixtures.released`). For each, the test restores it, leaves the rows
an outage leaves behind in it (ready, leased by a member that died, waiting for
a retry, dead of the outage, dead for real, finished but not yet pruned), upgrades
it with today's `pgq init` while the group's breaker is OPEN, and drains it with
one cron-style run, whose probe closes the group and is logged (schema version 3).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from fixtures.released import RELEASED, restore
from helpers import FAST
from roles import consumer_role, job_role
from sqlalchemy import Engine, text

import pgq
from pgq import monitor
from pgq.sql.privileges import ADMIN_REMOVALS
from pgq.store import run_once
from pgq.store.migrations import LATEST
from pgq.store.privileges import require_privileges


@pytest.fixture(params=RELEASED, ids=lambda v: f"v{v}")
def version(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def released(version: int, pg_dsn: str, schema: str) -> Iterator[Engine]:
    """The test's schema as an earlier version released it, with group `g` on topic `t`
    as that version subscribed it (its own statements: today's need today's schema)."""
    restore(pg_dsn, schema, version)
    engine = pgq.connect(pg_dsn, schema=schema)
    s = f'"{schema}"'
    sql(engine, f"INSERT INTO {s}.topic (name) VALUES ('t')")
    sql(engine, f"INSERT INTO {s}.consumer_group (name, topic_id) SELECT 'g', id FROM {s}.topic")
    sql(engine, f"INSERT INTO {s}.breaker (group_id) SELECT id FROM {s}.consumer_group")
    if version >= 4:
        sql(engine, f"INSERT INTO {s}.group_state (group_id) SELECT id FROM {s}.consumer_group")
    yield engine
    engine.dispose()


def test_every_version_before_the_latest_has_a_fixture():
    assert tuple(range(1, LATEST)) == RELEASED


def sql(engine: Engine, statement: str, **params: object) -> None:
    with engine.begin() as conn:
        conn.execute(text(statement), params)


def released_role(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.scalar(text("SELECT current_user")))


def publish_as_released(engine: Engine, schema: str, n: int) -> list[int]:
    """Publish `n` messages to `t` in one transaction as versions 1-3 did: each
    delivery row copies its message's xid."""
    s = f'"{schema}"'
    with engine.begin() as conn:
        ids = conn.scalars(
            text(
                f"INSERT INTO {s}.message (topic_id, payload)"
                f" SELECT tp.id, jsonb_build_object('i', i) FROM {s}.topic tp,"
                " generate_series(1, :n) i ORDER BY i RETURNING id"
            ),
            {"n": n},
        ).all()
        conn.execute(
            text(
                f"INSERT INTO {s}.delivery (group_id, message_id, xid)"
                f" SELECT g.id, m.id, m.xid FROM {s}.message m, {s}.consumer_group g"
                " WHERE m.id = ANY(:ids)"
            ),
            {"ids": list(ids)},
        )
    return sorted(ids)


def test_init_upgrades_a_database_in_use_and_it_drains(released: Engine, schema: str, version: int):
    s = f'"{schema}".delivery'
    # two messages the group finished and pruned before the upgrade, with the
    # frontier and the running totals the earlier version kept on the group row
    pruned = publish_as_released(released, schema, 2)
    sql(released, f"DELETE FROM {s}")
    # versions 1-3 kept them on the group row, version 4 in group_state
    state = "group_state" if version >= 4 else "consumer_group"
    sql(
        released,
        f'UPDATE "{schema}".{state} SET committed_xid = m.xid, committed_id = m.id,'
        " done_pruned = 2, reclaimed_total = 5, released_total = 7, refunded_total = 11"
        f' FROM "{schema}".message m WHERE m.id = :last',
        last=pruned[-1],
    )
    # an audit row as every earlier version wrote it (before 5 no role, no names)
    names = ("", "") if version < 5 else (", group_name, topic", ", 'g', 't'")
    sql(
        released,
        f'INSERT INTO "{schema}".audit (group_id, action, message_ids, count, reason, actor'
        f"{names[0]}) SELECT id, 'purge', '[{pruned[0]}]', 1, 'before', 'ops@old'{names[1]}"
        f' FROM "{schema}".consumer_group',
    )
    ids = publish_as_released(released, schema, 48)
    ready, leased, retrying, outage, poison, finished = (ids[i : i + 8] for i in range(0, 48, 8))
    # what an earlier version left: a member died holding leases; retries waiting (a
    # message failure, and a snooze after a systemic failure, which version 1 kept
    # systemic); an outage (epoch 1, still OPEN) killed rows; real dead letters
    sql(
        released,
        f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = 1, next_probe_at = now()",
    )
    sql(
        released,
        f"UPDATE {s} SET state = 'leased', lease_owner = 'gone', lease_seq = nextval("
        f"'\"{schema}\".lease_token'), lease_expires_at = now() - interval '1 second'"
        " WHERE message_id = ANY(:ids)",
        ids=leased,
    )
    sql(
        released,
        f"UPDATE {s} SET attempts = 1, error_class = 'message', last_error = 'ValueError',"
        " error_epoch = 0, available_at = now() + interval '2 seconds'"
        " WHERE message_id = ANY(:ids)",
        ids=retrying[:4],
    )
    sql(
        released,
        f"UPDATE {s} SET attempts = 1, refundable_attempts = 1, error_class = 'systemic',"
        " error_epoch = 0, available_at = now() + interval '2 seconds'"
        " WHERE message_id = ANY(:ids)",
        ids=retrying[4:],
    )
    sql(
        released,
        f"UPDATE {s} SET state = 'dead', attempts = 3, refundable_attempts = 3,"
        " error_class = 'systemic', last_error = 'ConnectionError', error_epoch = 0"
        " WHERE message_id = ANY(:ids)",
        ids=outage,
    )
    sql(
        released,
        f"UPDATE {s} SET state = 'dead', attempts = 3, error_class = 'message',"
        " last_error = 'ValueError', error_epoch = 0 WHERE message_id = ANY(:ids)",
        ids=poison,
    )

    # finished rows not yet pruned (every version marks some done: version 6 keeps a
    # batch's last one for the frontier)
    sql(
        released,
        f"UPDATE {s} SET state = 'done', attempts = 1 WHERE message_id = ANY(:ids)",
        ids=finished,
    )

    assert pgq.migrate(released) == LATEST
    assert pgq.migrate(released) == LATEST  # idempotent
    with released.connect() as conn:
        versions = conn.execute(text(f'SELECT version FROM "{schema}".schema_version')).scalars()
        assert sorted(versions) == list(range(1, LATEST + 1))
        for added in ("delivery_charged_idx", "probe", "probe_at_idx", "group_state"):
            assert conn.scalar(text(f"SELECT to_regclass('\"{schema}\".{added}')")), added
    # version 4: the frontier and the totals moved to group_state, as they were
    before = pgq.status(released, "g")
    assert before["committed"] == pruned[-1]
    assert before["counts"]["done"] == 2 + len(finished)
    assert before["totals"] == {"reclaimed": 5, "released": 7, "refunded": 11}
    state, line = monitor.check(released, "g")
    assert (state, line.split(";")[0]) == ("CRITICAL", "CRITICAL: 8 dead rows (8 message)")
    # version 5: the audit row written before names its group and topic, not a role
    [before_row] = monitor.audit(released, "g")
    # (version 5 itself recorded the role already)
    role = None if version < 5 else released_role(released)
    assert (before_row["actor"], before_row["role"]) == ("ops@old", role)
    assert (before_row["group"], before_row["topic"]) == ("g", "t")

    handled: list[tuple[int, int]] = []
    consumer = pgq.Consumer(
        released,
        "g",
        lambda m: handled.append((m.id, m.attempt)),
        **FAST,
        lease=5,
        breaker_min_members=1,
    )
    summary = consumer.run(until_empty=True, wait_retries=10)
    assert summary.stop_reason == "empty"

    status = pgq.status(released, "g")
    assert status["breaker"]["state"] == "CLOSED"
    assert status["counts"]["dead"] == len(poison)
    assert status["counts"]["ready"] == status["counts"]["leased"] == 0
    assert status["counts"]["done"] == len(pruned) + 32 + len(finished)
    attempts = dict(handled)
    assert sorted(attempts) == sorted(ready + leased + retrying + outage)
    assert all(attempts[i] == 1 for i in ready + leased + outage + retrying[4:])
    assert all(attempts[i] == 2 for i in retrying[:4])
    # the dead member's leases expired while the group was OPEN: charged, refunded too
    assert status["totals"]["refunded"] == 11 + len(outage) + len(retrying[4:]) + len(leased)
    assert status["totals"]["reclaimed"] == 5 + len(leased)
    assert status["totals"]["released"] >= 7
    assert status["committed"] >= pruned[-1]  # never behind where it was
    # the run's probe closed the group, and the probe log has it (version 3)
    [probe] = monitor.breaker_info(released, "g")["probes"]
    assert (probe["epoch"], probe["outcome"], probe["member"]) == (1, "succeeded", consumer.name)
    assert probe["message_id"] in ids
    # version 7: the messages published before have no dedupe key; a key publishes
    # once, and runs once
    first = pgq.publish(released, "t", {"after": "upgrade"}, dedupe_key="once")
    assert pgq.publish(released, "t", {"again": True}, dedupe_key="once") == first
    again = pgq.Consumer(released, "g", lambda m: handled.append((m.id, m.attempt)), **FAST)
    assert again.run(until_empty=True).done == 1
    assert handled[-1] == (first, 1)
    # the upgraded group can be removed, and its trail, old rows too, still read
    pgq.unsubscribe(released, "g", reason="after the upgrade")
    trail = monitor.audit(released, "g")
    assert [(a["action"], a["reason"]) for a in trail] == [
        ("unsubscribe", "after the upgrade"),
        ("purge", "before"),
    ]


def test_init_keeps_each_role_able_to_do_its_job(
    released: Engine, pg_dsn: str, schema: str, version: int
):
    """Roles granted a producer's, a consumer's and an administrator's privileges
    before the upgrade get what their job needs on the tables added since (the probe
    log, version 3; group_state, version 4; a message's history, version 9) and for
    what it can do since (an administrator removes groups and topics, version 5; a
    producer publishes with dedupe keys, version 7), and no more: the consumer is
    not refused at start and drains, the producer publishes, `pgq breaker` works
    for the administrator."""
    added = [("group_state", p) for p in ("SELECT", "UPDATE")] if version < 4 else []
    if version < 3:
        added += [("probe", p) for p in ("SELECT", "INSERT", "DELETE")]
    if version < 9:  # a message's history
        added += [("attempt", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")]
    removals = [(name, p) for name, ps in ADMIN_REMOVALS.items() for p in ps] if version < 5 else []
    # version 7: what publishing with dedupe keys needs (the column is new)
    keys = [("message.topic_id", "SELECT"), ("message.dedupe_key", "SELECT")] if version < 7 else []
    # version 9: the charts' samples (decision 0045), a table no fixture has
    samples = [("group_sample", p) for p in ("SELECT", "INSERT", "DELETE")] if version < 9 else []
    with (
        consumer_role(pg_dsn, schema, without=added + samples) as (consumer, consumer_dsn),
        job_role(pg_dsn, schema, "admin", without=added + removals + samples) as (admin, admin_dsn),
        job_role(pg_dsn, schema, "producer", without=added + keys) as (producer, producer_dsn),
    ):
        # what an earlier version granted a consumer besides: the frontier and the
        # totals were on the group row
        sql(released, f'GRANT UPDATE ON "{schema}".consumer_group TO "{consumer}"')
        assert pgq.migrate(released) == LATEST
        jobs = (("consumer", consumer_dsn), ("admin", admin_dsn), ("producer", producer_dsn))
        for job, dsn in jobs:
            eng = pgq.connect(dsn, schema=schema)
            try:
                run_once(eng, require_privileges, job)
            finally:
                eng.dispose()
        with released.connect() as conn:
            granted = conn.execute(
                text(
                    "SELECT has_table_privilege(:admin, :probe, 'INSERT'),"
                    " has_table_privilege(:admin, :state, 'UPDATE'),"
                    " has_table_privilege(:producer, :state, 'SELECT'),"
                    " has_table_privilege(:consumer, :group, 'DELETE'),"
                    " has_table_privilege(:producer, :samples, 'SELECT')"
                ),
                {
                    "admin": admin,
                    "producer": producer,
                    "consumer": consumer,
                    "probe": f'"{schema}".probe',
                    "state": f'"{schema}".group_state',
                    "group": f'"{schema}".consumer_group',
                    "samples": f'"{schema}".group_sample',
                },
            ).one()
        assert tuple(granted) == (False, False, False, False, False)
        eng = pgq.connect(producer_dsn, schema=schema)
        try:
            pgq.publish(eng, "t", {"n": 1})
            first = pgq.publish(eng, "t", {"n": 2}, dedupe_key="k")
            assert pgq.publish(eng, "t", {"n": 3}, dedupe_key="k") == first
        finally:
            eng.dispose()
        eng = pgq.connect(consumer_dsn, schema=schema)
        try:
            summary = pgq.Consumer(eng, "g", lambda m: None, **FAST).run(until_empty=True)
        finally:
            eng.dispose()
        assert (summary.stop_reason, summary.done) == ("empty", 2), consumer


@pytest.fixture(params=[*RELEASED, LATEST], ids=lambda v: f"v{v}")
def any_version(request: pytest.FixtureRequest, pg_dsn: str, schema: str) -> Iterator[Engine]:
    """The test's schema upgraded from each released version (its `lease_token`
    sequence is the one earlier members drew from), or made today, with a topic and
    a group (made by today's code, after the upgrade: version 4 moved the group's
    frontier to a table of its own)."""
    engine = pgq.connect(pg_dsn, schema=schema)
    if request.param < LATEST:
        restore(pg_dsn, schema, request.param)
    pgq.migrate(engine)
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    yield engine
    engine.dispose()


def test_leases_taken_with_the_global_token_are_acked_after_the_upgrade(
    any_version: Engine, schema: str
):
    """Members of earlier versions gave each row a token of its own from the
    `lease_token` sequence (decision 0004). Such a token stays its row's current
    one, so today's fence, by (message id, token) pairs, accepts the lease's outcome
    after the upgrade; the row's next claim takes a token of today's kind (negative,
    from a block drawn from the same sequence), which no earlier lease ever had, and
    a stale outcome for the first row in the same batch as another row's current one
    applies to the latter only."""
    import datetime as dt

    from pgq.records import Claimed, Lease, Message, Outcome
    from pgq.store import GroupStore, group_info
    from pgq.store.scope import TOKEN_BITS

    engine = any_version
    a, b, c = pgq.publish_many(engine, "t", [{"n": i} for i in range(3)])
    with engine.begin() as conn:  # the earlier version's claim of a, b, then c
        conn.execute(text(f"SELECT setval('\"{schema}\".lease_token', 40)"))
        tokens = {}
        for mid in (a, b, c):
            tokens[mid] = conn.scalar(
                text(
                    f"UPDATE \"{schema}\".delivery SET state = 'leased', lease_owner = 'm',"
                    f" lease_seq = nextval('\"{schema}\".lease_token'),"
                    " lease_expires_at = now() + interval '1 minute'"
                    " WHERE message_id = :id RETURNING lease_seq"
                ),
                {"id": mid},
            )
    assert [tokens[a], tokens[b], tokens[c]] == [41, 42, 43]
    assert pgq.migrate(engine) == LATEST
    store = GroupStore(group_info(engine, "g").id, "g", "t", "m", 60.0, 3)

    def held(mid: int, seq: int) -> Claimed:
        now = dt.datetime.now(dt.timezone.utc)
        return Claimed(Message(mid, "t", "g", None, {}, None, 1, now), Lease(mid, seq), 0)

    assert run_once(engine, store.record, [Outcome(held(a, 41), "done")]) == {Lease(a, 41)}
    assert run_once(engine, store.release, [Lease(b, 42)]) == {Lease(b, 42)}
    [again] = run_once(engine, store.claim, 1, 0)
    assert again.id == b
    assert again.seq < 0 and -again.seq >> TOKEN_BITS > 43  # a block drawn after them
    batch = [Outcome(held(b, 42), "done"), Outcome(held(c, 43), "done")]
    assert run_once(engine, store.record, batch) == {Lease(c, 43)}
    assert run_once(engine, store.record, [Outcome(again, "done")]) == {again.lease}
    status = pgq.status(engine, "g")
    assert status["counts"]["done"] == 3, status["counts"]
    assert status["counts"]["ready"] == status["counts"]["leased"] == 0


def dedupe_index(engine: Engine, schema: str) -> tuple[int, bool] | None:
    """(oid, valid) of the schema's dedupe index, None without one."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT indexrelid::bigint, indisvalid FROM pg_index"
                " WHERE indexrelid = to_regclass(:name)"
            ),
            {"name": f'"{schema}".message_dedupe_key_idx'},
        ).first()
    return None if row is None else (int(row[0]), bool(row[1]))


@pytest.mark.parametrize("left", ["valid", "invalid"])
def test_a_dedupe_index_built_concurrently_beforehand_is_kept_or_built_again(
    pg_dsn: str, schema: str, left: str
):
    """Version 7's index, built by an operator with `CREATE INDEX CONCURRENTLY` before
    `pgq init` (docs/operations.md: publishing is not held), is kept as it is; one
    such build that failed leaves an invalid index, which `pgq init` builds again."""
    restore(pg_dsn, schema, 6)
    s = f'"{schema}"'
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {s}.topic (name) VALUES ('t')")
        conn.execute(f"ALTER TABLE {s}.message ADD COLUMN dedupe_key text")
        rows = 2 if left == "invalid" else 1  # a duplicate makes the build fail
        conn.execute(
            f"INSERT INTO {s}.message (topic_id, payload, dedupe_key)"
            f" SELECT id, '{{}}', 'k' FROM {s}.topic, generate_series(1, {rows})"
        )
        build = (
            f"CREATE UNIQUE INDEX CONCURRENTLY message_dedupe_key_idx ON {s}.message"
            " (topic_id, dedupe_key) WHERE dedupe_key IS NOT NULL"
        )
        if left == "invalid":
            with pytest.raises(psycopg.errors.UniqueViolation):
                conn.execute(build)
            conn.execute(f"DELETE FROM {s}.message WHERE id = (SELECT max(id) FROM {s}.message)")
        else:
            conn.execute(build)
    engine = pgq.connect(pg_dsn, schema=schema)
    try:
        before = dedupe_index(engine, schema)
        assert before is not None and before[1] == (left == "valid")
        assert pgq.migrate(engine) == LATEST
        after = dedupe_index(engine, schema)
        assert after is not None and after[1]
        assert (after[0] == before[0]) == (left == "valid")  # kept, or built again
        [kept] = pgq.publish_many(engine, "t", [{}], dedupe_keys=["k"])
        assert kept == 1
    finally:
        engine.dispose()
