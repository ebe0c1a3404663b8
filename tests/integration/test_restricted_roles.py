"""Roles restricted to topics and groups: `pgq grant ROLE JOB [--topic T ...]
[--group G ...]` (issue 21, decision 0034).

Topic `orders` has groups `billing` and `shipping`, topic `payroll` group `hr`.
A `--consumer --group billing` role is refused, or finds nothing, for every
statement on another group's or topic's rows (each statement and its outcome
are listed), and still runs billing's consumer through a whole outage; roles
granted before the first restriction keep every row; a producer restricted to
`orders` publishes there only; re-granting replaces the restriction, a grant
without `--topic`/`--group` lifts it, and `pgq init` runs with the policies.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import psycopg
import pytest
from helpers import FAST, LONE_OUTAGE, PGQ, consumer_env, invoke, read_ids, wait_until
from psycopg import sql
from roles import login_role
from sqlalchemy import Engine, func, select

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.errors import PermissionDenied, UnknownGroup, UnknownTopic
from pgq.store import group_info, purge, requeue


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    return ("billing", "shipping")


class Role(NamedTuple):
    name: str
    dsn: str
    engine: Engine


@pytest.fixture
def world(orders: Engine) -> dict[str, Any]:
    """Topic `payroll` with group `hr` beside `orders`; messages on both, and a dead
    row in `shipping` and in `hr` (the rows a purge would delete)."""
    pgq.create_topic(orders, "payroll")
    pgq.subscribe(orders, "hr", "payroll")
    secret = pgq.publish(orders, "payroll", {"ssn": "078-05-1120", "salary": 10**6})
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])

    def refuse(msg: pgq.Message) -> None:
        raise pgq.PermanentError("no")

    for group in ("shipping", "hr"):
        pgq.Consumer(orders, group, refuse, **FAST).run(until_empty=True)
    return {
        "secret": secret,
        "ids": ids,
        **{group: group_info(orders, group).id for group in ("billing", "shipping", "hr")},
        "payroll": group_info(orders, "hr").topic_id,
    }


@pytest.fixture
def granted(pg_dsn: str, schema: str, pgq_env: dict[str, str]) -> Iterator[Callable[..., Role]]:
    """`granted(*args)`: a login role given `pgq grant ROLE *args`, with an engine."""
    with contextlib.ExitStack() as stack:

        def make(*args: str) -> Role:
            name, dsn = stack.enter_context(login_role(pg_dsn))
            result = invoke(pgq_env, "grant", name, *args)
            assert result.exit_code == 0, result.output
            eng = pgq.connect(dsn, schema=schema)
            stack.callback(eng.dispose)
            return Role(name, dsn, eng)

        yield make


KEPT = ("committed", "counts", "totals", "lag", "breaker")
"""What a snapshot keeps of a group's status (not its members nor who holds its
frontier back: they change as the test's own sessions come and go)."""


def snapshot(engine: Engine) -> dict[str, Any]:
    """What the owner sees of every group and topic."""
    with engine.connect() as conn:
        messages = conn.execute(
            select(t.message.c.topic_id, func.count()).group_by(t.message.c.topic_id)
        ).all()
    return {
        "messages": sorted(messages),
        **{
            g: {k: v for k, v in pgq.status(engine, g).items() if k in KEPT}
            for g in ("billing", "shipping", "hr")
        },
        "audit": [monitor.audit(engine, g) for g in ("billing", "shipping", "hr")],
    }


def attempt(dsn: str, statement: str) -> str:
    """Run `statement` as the role of `dsn` (rolled back): `error: <SQLSTATE name>`
    or `N rows`."""
    with psycopg.connect(dsn) as conn:
        try:
            cur = conn.execute(statement.encode())
        except psycopg.Error as exc:
            return f"error: {type(exc).__name__}"
        finally:
            conn.rollback()
        return f"{cur.rowcount} rows"


ATTACKS = {
    # another topic's messages
    "SELECT payload FROM {s}.message WHERE topic_id = {payroll}": "0 rows",
    "SELECT payload FROM {s}.message WHERE id = {secret}": "0 rows",
    "DELETE FROM {s}.message WHERE topic_id = {payroll}": "0 rows",
    "UPDATE {s}.message SET created_at = now() WHERE topic_id = {payroll}": "0 rows",
    "SELECT id FROM {s}.topic WHERE id = {payroll}": "0 rows",
    # its own topic's messages: other groups may still need them (retention's rule)
    "DELETE FROM {s}.message WHERE topic_id = (SELECT topic_id FROM {s}.consumer_group)": (
        "0 rows"
    ),
    # another group's definition, rows, breaker, state, members, probes, audit
    "SELECT * FROM {s}.consumer_group WHERE id IN ({shipping}, {hr})": "0 rows",
    "SELECT * FROM {s}.delivery WHERE group_id IN ({shipping}, {hr})": "0 rows",
    "DELETE FROM {s}.delivery WHERE group_id = {shipping}": "0 rows",  # a purge, unaudited
    "DELETE FROM {s}.delivery WHERE group_id = {hr} AND state = 'dead'": "0 rows",
    "UPDATE {s}.delivery SET state = 'ready', attempts = 0 WHERE group_id = {shipping}": "0 rows",
    "UPDATE {s}.delivery SET group_id = {shipping} WHERE group_id = {billing}": (
        "error: InsufficientPrivilege"  # its own rows, moved into another group
    ),
    "INSERT INTO {s}.delivery (group_id, message_id) VALUES ({shipping}, {secret})": (
        "error: InsufficientPrivilege"  # WITH CHECK: new row violates row-level security
    ),
    "UPDATE {s}.breaker SET state = 'OPEN', epoch = epoch + 1 WHERE group_id = {shipping}": (
        "0 rows"
    ),
    "SELECT * FROM {s}.breaker WHERE group_id = {hr}": "0 rows",
    "UPDATE {s}.group_state SET committed_id = 2^40 WHERE group_id = {shipping}": "0 rows",
    "SELECT * FROM {s}.group_state WHERE group_id <> {billing}": "0 rows",
    "INSERT INTO {s}.member (group_id, name, host, pid) VALUES ({shipping}, 'x', 'h', 1)": (
        "error: InsufficientPrivilege"
    ),
    "SELECT * FROM {s}.member WHERE group_id = {shipping}": "0 rows",
    "INSERT INTO {s}.breaker_history (group_id, epoch, state) VALUES ({hr}, 99, 'OPEN')": (
        "error: InsufficientPrivilege"
    ),
    "UPDATE {s}.breaker_history SET refunded = 0 WHERE group_id = {shipping}": "0 rows",
    "DELETE FROM {s}.probe WHERE group_id = {hr}": "0 rows",
    "SELECT * FROM {s}.audit WHERE group_id <> {billing}": "error: InsufficientPrivilege",
}
"""Each statement a `--consumer --group billing` role tries, and what happens."""


def test_a_group_restricted_consumer_cannot_touch_another_group_or_topic(
    orders, world, granted, schema
):
    before = snapshot(orders)
    role = granted("--consumer", "--group", "billing")
    outcomes = {}
    for statement in ATTACKS:
        text = statement.format(s=sql.Identifier(schema).as_string(None), **world)
        outcomes[statement] = attempt(role.dsn, text)
    assert outcomes == ATTACKS
    # what it can see: its group, its topic, its topic's messages
    assert attempt(role.dsn, f'SELECT * FROM "{schema}".consumer_group') == "1 rows"
    assert attempt(role.dsn, f'SELECT * FROM "{schema}".topic') == "1 rows"
    assert attempt(role.dsn, f'SELECT * FROM "{schema}".message') == "3 rows"
    # through pgq: another group is unknown to it
    for call in (
        lambda: pgq.status(role.engine, "shipping"),
        lambda: monitor.dead(role.engine, "hr"),
    ):
        with pytest.raises(UnknownGroup):
            call()
    assert [g["group"] for g in monitor.status_all(role.engine)["groups"]] == ["billing"]
    assert snapshot(orders) == before


def test_a_group_restricted_admin_administers_that_group_only(orders, world, granted):
    before = snapshot(orders)
    admin = granted("--admin", "--group", "shipping")
    assert [g["group"] for g in monitor.status_all(admin.engine)["groups"]] == ["shipping"]
    for call in (
        lambda: purge(admin.engine, "hr", reason="not mine"),
        lambda: requeue(admin.engine, "billing", all_dead=True, reason="not mine"),
        lambda: monitor.message(admin.engine, "hr", world["secret"]),
    ):
        with pytest.raises(UnknownGroup):
            call()
    assert snapshot(orders) == before
    assert requeue(admin.engine, "shipping", all_dead=True, reason="mine").count == 3
    assert [a["action"] for a in monitor.audit(admin.engine, "shipping")] == ["requeue"]


def test_a_topic_restricted_producer_publishes_to_that_topic_only(orders, world, granted, schema):
    producer = granted("--producer", "--topic", "orders")
    before = snapshot(orders)
    with pytest.raises(UnknownTopic):  # invisible to it
        pgq.publish(producer.engine, "payroll", {"n": 1})
    s = sql.Identifier(schema).as_string(None)
    forged = {
        f"INSERT INTO {s}.message (topic_id, payload) VALUES ({world['payroll']}, '1')": (
            "error: InsufficientPrivilege"
        ),
        f"INSERT INTO {s}.delivery (group_id, message_id) VALUES ({world['hr']}, 1)": (
            "error: InsufficientPrivilege"
        ),
        f"SELECT payload FROM {s}.message": "error: InsufficientPrivilege",  # ids, keys only
        # (it reads topic ids and dedupe keys to publish with keys: not another topic's)
        f"SELECT id FROM {s}.message WHERE topic_id = {world['payroll']}": "0 rows",
        f"SELECT id FROM {s}.message": "3 rows",  # its topic's: not payroll's
        f"SELECT * FROM {s}.consumer_group WHERE id = {world['hr']}": "0 rows",
    }
    assert {st: attempt(producer.dsn, st) for st in forged} == forged
    assert snapshot(orders) == before
    ids = pgq.publish_many(producer.engine, "orders", [{"n": 10}, {"n": 11}])
    with producer.engine.begin() as conn:  # inside its own transaction
        ids.append(pgq.publish(conn, "orders", {"n": 12}, delay=0))
    assert pgq.status(orders, "billing")["counts"]["ready"] == 3 + len(ids)
    assert pgq.status(orders, "shipping")["counts"]["ready"] == len(ids)  # its 3 are dead
    # a group subscribed later to its topic gets rows too
    pgq.subscribe(orders, "audit_log", "orders", start="latest")
    pgq.publish(producer.engine, "orders", {"n": 13})
    assert pgq.status(orders, "audit_log")["counts"]["ready"] == 1
    # with dedupe keys: its topic's message is found again; another topic's with the
    # same key is none of its business
    pgq.publish(orders, "payroll", {"n": 14}, dedupe_key="k")
    first = pgq.publish(producer.engine, "orders", {"n": 15}, dedupe_key="k")
    assert pgq.publish(producer.engine, "orders", {"n": 16}, dedupe_key="k") == first
    assert pgq.status(orders, "audit_log")["counts"]["ready"] == 2


def age(engine: Engine) -> None:
    """Make every message an hour old: past a retention of 60 s."""
    with engine.begin() as conn:
        conn.execute(t.message.update().values(created_at=func.now() - dt.timedelta(hours=1)))


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    words = ("task refused", "pass refused", "crashed", "permission denied", "task failed", "lacks")
    return [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in words)]


def test_a_group_restricted_consumer_runs_a_whole_outage(orders, world, granted, caplog):
    """Claims, failures, the quorum opening billing, probes, the close and its
    reconciliation, pruning, retention: nothing refused, under `--group billing`."""
    caplog.set_level(logging.INFO, logger="pgq")
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(12)])
    others = {g: pgq.status(orders, g) for g in ("shipping", "hr")}
    down = threading.Event()
    down.set()

    def handler(msg: pgq.Message) -> None:
        if down.is_set():
            raise pgq.SystemicError("dependency down")

    role = granted("--consumer", "--group", "billing")
    consumer = pgq.Consumer(role.engine, "billing", handler, **LONE_OUTAGE)
    consumer.start()
    try:
        wait_until(
            lambda: pgq.status(orders, "billing")["breaker"]["state"] == "OPEN",
            20,
            "the quorum to open the group",
        )
        down.clear()
        wait_until(
            lambda: (
                (s := pgq.status(orders, "billing"))["breaker"]["state"] == "CLOSED"
                and s["lag"] == 0
            ),
            30,
            "the prober to close the group and the backlog to drain",
        )
    finally:
        consumer.stop(timeout=10)
    status = pgq.status(orders, "billing")
    assert status["counts"]["done"] == len(ids) + 3 and status["counts"]["dead"] == 0
    assert status["breaker"]["epoch"] >= 2  # opened and closed
    assert status["totals"]["refunded"] >= 1  # reconciled
    assert not refusals(caplog), refusals(caplog)
    # a cron run: retention (probes, messages) and pruning at its start, nothing refused
    age(orders)
    drained = pgq.Consumer(role.engine, "billing", handler, **LONE_OUTAGE, retention=60).run(
        until_empty=True
    )
    assert drained.stop_reason == "empty"
    assert not refusals(caplog), refusals(caplog)
    # shipping has not handled them: a role that sees only billing deletes none
    assert {g: pgq.status(orders, g)["counts"] for g in others} == {
        g: s["counts"] for g, s in others.items()
    }
    with orders.connect() as conn:
        assert conn.execute(select(func.count()).select_from(t.message)).scalar() == 16


def test_pgq_consume_under_a_group_restricted_role(orders, world, granted, pgq_env, tmp_path):
    """The command, as a subprocess: billing drains; shipping is an unknown group."""
    role = granted("--consumer", "--group", "billing")
    env = {**consumer_env(pgq_env, tmp_path), "PGQ_DSN": role.dsn, "PGQ_POLL_INTERVAL": "0.1"}

    def consume(group: str) -> subprocess.CompletedProcess[str]:
        args = ["consume", group, "--handler", "handlers:record", "--until-empty"]
        return subprocess.run(
            [*PGQ, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    drained = consume("billing")
    assert drained.returncode == 0, drained.stderr
    assert sorted(read_ids(tmp_path, "handled")) == world["ids"]
    refused = consume("shipping")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == ["pgq: error: unknown group 'shipping'"]
    assert pgq.status(orders, "shipping")["counts"]["dead"] == 3


def test_a_topic_restricted_consumer_runs_retention(orders, world, granted):
    """Given the whole topic, a role sees every group of it and deletes what every
    group finished, and only that (shipping's dead rows keep theirs)."""
    role = granted("--consumer", "--topic", "orders")
    fresh = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])

    def finished() -> bool:
        """Each group ran, and the frontiers pruned every row of `fresh` (a frontier
        waits for transactions older than the rows, which other sessions may hold)."""
        for group in ("shipping", "billing"):
            pgq.Consumer(orders, group, lambda m: None, **FAST).run(until_empty=True)
        with orders.connect() as conn:
            held = t.delivery.c.message_id.in_(fresh)
            return not conn.execute(select(func.count()).where(held)).scalar()

    wait_until(finished, 20, "both groups to finish and prune the fresh messages")
    with orders.connect() as conn:
        left = conn.execute(select(t.message.c.id).order_by(t.message.c.id)).scalars().all()
    assert set(fresh) <= set(left)
    age(orders)
    pgq.Consumer(role.engine, "billing", lambda m: None, **FAST, retention=60).run(until_empty=True)
    with orders.connect() as conn:
        kept = set(conn.execute(select(t.message.c.id)).scalars().all())
    assert kept == {world["secret"], *world["ids"]}  # payroll's, and shipping's dead ones


def test_roles_granted_before_the_first_restriction_keep_every_row(
    orders, world, granted, pg_dsn, schema, pgq_env
):
    """Row-level security comes on with the first restricted grant; `pgq_all` keeps
    every other role (granted by an earlier pgq, by hand, or unrestricted) as it was."""
    producer, consumer, admin = (granted(f"--{job}") for job in ("producer", "consumer", "admin"))
    with login_role(pg_dsn) as (monitoring, monitoring_dsn):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            who, s = sql.Identifier(monitoring), sql.Identifier(schema)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, who))
            conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(s, who))
        granted("--consumer", "--group", "billing")  # the first restriction
        with psycopg.connect(pg_dsn) as conn:
            secured = conn.execute(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relrowsecurity",
                [schema],
            ).fetchone()
        assert secured == (11,)
        watcher = pgq.connect(monitoring_dsn, schema=schema)
        try:
            assert len(monitor.status_all(watcher)["groups"]) == 3
        finally:
            watcher.dispose()
    assert len(monitor.status_all(admin.engine)["groups"]) == 3
    assert purge(admin.engine, "hr", reason="cleanup").count == 1
    pgq.publish(producer.engine, "payroll", {"n": 1})
    summary = pgq.Consumer(consumer.engine, "hr", lambda m: None, **FAST).run(until_empty=True)
    assert summary.done == 1
    assert invoke(pgq_env, "init").exit_code == 0  # migrate runs with the policies there


def policies_of(pg_dsn: str, schema: str, role: str) -> list[str]:
    """`table: USING` of every policy restricting `role`."""
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT tablename || ': ' || coalesce(qual, '') FROM pg_policies"
            " WHERE schemaname = %s AND %s = ANY (roles) ORDER BY 1",
            [schema, role],
        ).fetchall()
    return [r[0] for r in rows]


def test_grant_again_replaces_the_restriction_and_without_lifts_it(
    orders, world, granted, pg_dsn, schema, pgq_env
):
    role = granted("--consumer", "--group", "billing")
    first = policies_of(pg_dsn, schema, role.name)
    assert len(first) == 13
    again = invoke(pgq_env, "grant", role.name, "--consumer", "--group", "billing")
    assert again.exit_code == 0, again.output
    assert policies_of(pg_dsn, schema, role.name) == first  # idempotent
    # and restricted so already, it runs no policy statement (they lock each table)
    assert [line for line in again.output.splitlines() if not line.startswith("GRANT ")] == []
    printed = invoke(pgq_env, "grant", role.name, "--consumer", "--group", "hr", "--print")
    assert printed.exit_code == 0 and policies_of(pg_dsn, schema, role.name) == first
    moved = invoke(pgq_env, "grant", role.name, "--consumer", "--group", "hr")
    assert moved.output == printed.output
    assert [g["group"] for g in monitor.status_all(role.engine)["groups"]] == ["hr"]
    lifted = invoke(pgq_env, "grant", role.name, "--consumer")
    assert lifted.exit_code == 0, lifted.output
    assert policies_of(pg_dsn, schema, role.name) == []
    assert len(monitor.status_all(role.engine)["groups"]) == 3


@pytest.mark.parametrize("power", ["SUPERUSER", "BYPASSRLS", "owner"])
def test_a_role_that_bypasses_row_level_security_is_not_restricted(
    orders, world, pg_dsn, schema, pgq_env, power
):
    """A restriction it would ignore is refused, not granted in silence."""
    with login_role(pg_dsn) as (name, _):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            who = sql.Identifier(name)
            if power == "owner":  # a member of the owner has its privileges
                owner = conn.execute("SELECT current_user").fetchone()
                assert owner is not None
                conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(owner[0]), who))
            else:
                conn.execute(sql.SQL("ALTER ROLE {} " + power).format(who))
        result = invoke(pgq_env, "grant", name, "--consumer", "--group", "billing")
        assert result.exit_code == 2, result.output
        assert "bypasses row-level security" in result.output
        assert policies_of(pg_dsn, schema, name) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--consumer", "--group", "nope"), "unknown group 'nope'"),
        (("--admin", "--topic", "nope"), "unknown topic 'nope'"),
        (("--producer", "--group", "billing"), "--group is for --consumer and --admin"),
        (("--consumer", "--group", "bad name"), "invalid group name"),
    ],
)
def test_a_bad_restriction_is_refused_and_grants_nothing(
    orders, world, pg_dsn, schema, pgq_env, args, says
):
    with login_role(pg_dsn) as (name, dsn):
        result = invoke(pgq_env, "grant", name, *args)
        assert result.exit_code == 2, result.output
        assert says in result.output and len(result.output.splitlines()) == 1
        assert policies_of(pg_dsn, schema, name) == []
        eng = pgq.connect(dsn, schema=schema)
        try:
            with pytest.raises(PermissionDenied):
                monitor.status_all(eng)
        finally:
            eng.dispose()
