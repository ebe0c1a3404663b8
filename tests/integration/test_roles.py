"""Least-privilege roles: `pgq grant ROLE (--producer | --consumer | --admin) [--print]`.

A producer and a consumer run under roles made by `pgq grant` (the producer
publishes, the consumer drains, each is refused the other's job); the
producer's and the administrator's lists in `pgq.sql.privileges` are exact (a
role with the list does the whole job, and each entry removed in turn is
found needed); `--print` prints what `pgq grant` runs and runs nothing; role
names are quoted identifiers, and the ones that cannot be are refused.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import psycopg
import pytest
from helpers import FAST, PGQ, consumer_env, invoke, read_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from roles import everything, job_role, login_role
from sqlalchemy import Engine, func, select

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.errors import PermissionDenied
from pgq.sql.privileges import ADMIN_TABLES
from pgq.store import purge, requeue
from pgq.store.privileges import grant, grant_sql
from pgq.store.samples import sample_every_group


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    """Two groups: a publish writes one delivery row for each."""
    return ("billing", "shipping")


class Role(NamedTuple):
    name: str
    dsn: str
    engine: Engine
    env: dict[str, str]


@pytest.fixture
def as_role(pg_dsn: str, schema: str, pgq_env: dict[str, str]) -> Iterator[Callable[..., Role]]:
    """`as_role(job, *without)`: a login role with `job`'s privileges minus `without`
    granted by hand (`job=None`: none at all), a pgq engine on this test's schema
    that logs in as it, and a `pgq` environment for it (all gone at the end)."""
    with contextlib.ExitStack() as stack:

        def make(job: str | None, *without: tuple[str, str]) -> Role:
            made = job_role(pg_dsn, schema, job, without) if job else login_role(pg_dsn)
            name, dsn = stack.enter_context(made)
            eng = pgq.connect(dsn, schema=schema)
            stack.callback(eng.dispose)
            return Role(name, dsn, eng, {**pgq_env, "PGQ_DSN": dsn})

        yield make


def granted(pg_dsn: str, schema: str, role: str) -> set[tuple[str, str]]:
    """What `role` was granted on `schema`, its tables, their columns and its
    sequences, from the catalogs' access lists: {("schema", "USAGE"),
    ("message", "SELECT"), ("topic.created_at", "UPDATE"), ...}."""
    query = """
        SELECT 'schema', a.privilege_type
        FROM pg_namespace n, aclexplode(n.nspacl) a
        WHERE n.nspname = %(schema)s
          AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = %(role)s)
        UNION ALL
        SELECT c.relname, a.privilege_type
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
             aclexplode(c.relacl) a
        WHERE n.nspname = %(schema)s
          AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = %(role)s)
        UNION ALL
        SELECT c.relname || '.' || att.attname, a.privilege_type
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             JOIN pg_attribute att ON att.attrelid = c.oid,
             aclexplode(att.attacl) a
        WHERE n.nspname = %(schema)s
          AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = %(role)s)
    """
    with psycopg.connect(pg_dsn) as conn:
        return {tuple(r) for r in conn.execute(query, {"schema": schema, "role": role})}  # type: ignore[misc]


def messages(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(t.message)).scalar_one())


def one_error_line(result: Any) -> str:
    """The one `pgq: error:` line of a failed in-process run (exit 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgq: error: "), result.output
    return lines[0]


def run_pgq(
    env: Mapping[str, str], *args: str, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """`pgq *args` as a subprocess (bounded)."""
    return subprocess.run(
        [*PGQ, *args], env=dict(env), input=stdin, capture_output=True, text=True, timeout=60
    )


def assert_one_line_exit_2(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgq: error: "), proc.stderr
    return lines[0]


# -- a producer and a consumer under roles made by `pgq grant` -----------------------


@pytest.fixture
def granted_roles(
    orders: Engine, pg_dsn: str, schema: str, pgq_env: dict[str, str]
) -> Iterator[dict[str, Role]]:
    """A producer, a consumer and an administrator, each made by `pgq grant`."""
    with contextlib.ExitStack() as stack:
        made = {}
        for job in ("producer", "consumer", "admin"):
            name, dsn = stack.enter_context(login_role(pg_dsn))
            result = invoke(pgq_env, "grant", name, f"--{job}")
            assert result.exit_code == 0, result.output
            assert result.output.splitlines() == grant_sql(schema, name, job)
            assert granted(pg_dsn, schema, name) == set(everything(job))
            eng = pgq.connect(dsn, schema=schema)
            stack.callback(eng.dispose)
            made[job] = Role(name, dsn, eng, {**pgq_env, "PGQ_DSN": dsn})
        yield made


def test_a_producer_and_a_consumer_under_roles_made_by_pgq_grant(granted_roles, orders, tmp_path):
    producer, consumer, admin = (granted_roles[j] for j in ("producer", "consumer", "admin"))
    proc = run_pgq(producer.env, "publish", "orders", stdin='{"n": 1}\n{"n": 2}\n')
    assert proc.returncode == 0, proc.stderr
    ids = [int(line) for line in proc.stdout.split()]
    with producer.engine.begin() as conn:  # inside the producer's own transaction
        ids += pgq.publish_many(conn, "orders", [{"n": 3}, {"n": 4}], key="k")
    with producer.engine.connect() as conn:  # rolled back: nothing published
        conn.begin()
        pgq.publish(conn, "orders", {"n": "never"})
        conn.rollback()

    env = {**consumer_env(consumer.env, tmp_path), "PGQ_POLL_INTERVAL": "0.1"}
    proc = run_pgq(env, "consume", "billing", "--handler", "handlers:record", "--until-empty")
    assert proc.returncode == 0, proc.stderr
    assert sorted(read_ids(tmp_path, "handled")) == sorted(ids)
    status = pgq.status(orders, "billing")
    assert status["counts"]["done"] == len(ids) and status["lag"] == 0
    assert pgq.status(orders, "shipping")["counts"]["ready"] == len(ids)  # its rows too

    proc = run_pgq(admin.env, "status", "billing", "--json")
    assert proc.returncode == 0, proc.stderr
    proc = run_pgq(admin.env, "requeue", "billing", "--all", "--reason", "roles test")
    assert (proc.returncode, proc.stdout.strip()) == (0, "requeued 0"), proc.stderr


def test_the_producer_role_cannot_consume(granted_roles, orders, schema, tmp_path):
    producer = granted_roles["producer"]
    pgq.publish(orders, "orders", {"n": 1})
    env = consumer_env(producer.env, tmp_path)
    proc = run_pgq(env, "consume", "billing", "--handler", "handlers:record", "--until-empty")
    line = assert_one_line_exit_2(proc)
    assert f"role {producer.name!r} lacks privileges a consumer needs: " in line
    assert f"UPDATE, DELETE on {schema}.delivery" in line  # it may only insert rows there
    assert pgq.status(orders, "billing")["counts"]["ready"] == 1  # nothing claimed


def test_the_consumer_role_cannot_publish(granted_roles, orders, schema):
    consumer = granted_roles["consumer"]
    before = messages(orders)
    with pytest.raises(PermissionDenied) as info:
        pgq.publish(consumer.engine, "orders", {"n": 1})
    assert "\n" not in str(info.value)
    line = assert_one_line_exit_2(run_pgq(consumer.env, "publish", "orders", '{"n": 1}'))
    assert "lacks privileges a producer needs: INSERT on" in line
    assert messages(orders) == before


def test_a_producer_reads_no_payload(granted_roles, orders, schema):
    """Failed before: `pgq grant --producer` gave SELECT on all of `message`, and a
    producer read every topic's payloads. It needs the ids its insert returns."""
    pgq.create_topic(orders, "payroll")
    pgq.publish(orders, "payroll", {"ssn": "078-05-1120", "salary": 10**6})
    producer = granted_roles["producer"]
    s = sql.Identifier(schema).as_string(None)
    read = []
    for statement in (
        f"SELECT payload FROM {s}.message",
        f"SELECT * FROM {s}.message",
        f"SELECT headers, key FROM {s}.message",
        f"SELECT count(*) FROM {s}.message WHERE payload ? 'ssn'",
    ):
        with psycopg.connect(producer.dsn) as conn:
            try:
                read.append((statement, conn.execute(statement.encode()).fetchall()))
            except psycopg.errors.InsufficientPrivilege:
                pass
    assert read == []
    assert pgq.publish(producer.engine, "orders", {"n": 1}) > 0  # and it still publishes


REWRITES = [
    ("producer", "UPDATE {s}.topic SET name = 'hijacked'"),
    ("consumer", "UPDATE {s}.topic SET name = 'hijacked'"),
    ("consumer", "UPDATE {s}.message SET payload = '{{\"amount\": 1e9}}'"),
    ("consumer", "UPDATE {s}.message SET key = 'forged', headers = NULL"),
    ("consumer", "UPDATE {s}.message SET topic_id = topic_id + 1"),
    ("consumer", "UPDATE {s}.message SET xid = '1'"),
]
"""Rewrites of rows pgq only locks, by the role that locks them."""


def test_a_role_cannot_rewrite_the_rows_it_only_locks(granted_roles, orders, schema):
    """pgq never updates a topic or a message: a producer locks its topic row, a
    consumer's retention locks both. Failed on d54e659 (`pgq grant` gave UPDATE on
    the whole table): the producer renamed topics, the consumer rewrote payloads."""
    pgq.publish(orders, "orders", {"amount": 10})
    rewrote = []
    for job, statement in REWRITES:
        text = statement.format(s=sql.Identifier(schema).as_string(None))
        with psycopg.connect(granted_roles[job].dsn) as conn:
            try:
                conn.execute(text.encode())
            except psycopg.errors.InsufficientPrivilege:
                continue
            finally:
                conn.rollback()
        rewrote.append(f"{job}: {text}")
    assert rewrote == []


# -- the producer's list is exact --------------------------------------------------


def producer_refusals(role: Role) -> set[str]:
    """Everything a producer does, as `role`: the operations the database refused."""
    eng = role.engine

    def in_transaction() -> None:
        with eng.begin() as conn:
            pgq.publish(conn, "orders", {"n": "tx"}, headers={"h": 1})
            pgq.publish_many(conn, "orders", [{"n": "tx2"}, {"n": "tx3"}], key="k", delay=30)

    def rolled_back() -> None:
        with eng.connect() as conn:
            conn.begin()
            pgq.publish(conn, "orders", {"n": "never"})
            conn.rollback()

    def deduplicated() -> None:
        first = pgq.publish(eng, "orders", {"n": 7}, dedupe_key="d1")
        assert pgq.publish(eng, "orders", {"n": 7}, dedupe_key="d1") == first  # read back
        ids = pgq.publish_many(eng, "orders", [{"n": 8}, {"n": 7}], dedupe_keys=["d2", "d1"])
        assert ids[1] == first

    def cli(*args: str, stdin: str | None = None) -> Callable[[], None]:
        def run() -> None:
            result = invoke(role.env, "publish", "orders", *args, stdin=stdin)
            refused = ("permission denied", "lacks privileges")
            if result.exit_code == 2 and any(word in result.output for word in refused):
                raise PermissionDenied(result.output)
            assert result.exit_code == 0, result.output

        return run

    work: dict[str, Callable[[], object]] = {
        "publish": lambda: pgq.publish(eng, "orders", {"n": 1}, key="k", headers={"h": 1}),
        "publish_many with delay": lambda: pgq.publish_many(eng, "orders", [{"n": 2}], delay=30),
        "in a transaction": in_transaction,
        "rolled back": rolled_back,
        "pgq publish": cli('{"n": 4}', "--key", "k"),
        "pgq publish stdin": cli(stdin='{"n": 5}\n{"n": 6}\n'),
        "publish with dedupe keys": deduplicated,
        "pgq publish --dedupe-key": cli('{"n": 9}', "--dedupe-key", "cli"),
    }
    refused = set()
    for what, do in work.items():
        try:
            do()
        except PermissionDenied:
            refused.add(what)
    return refused


PUBLISHED = {
    "publish": 1,
    "publish_many with delay": 1,
    "in a transaction": 3,
    "rolled back": 0,
    "pgq publish": 1,
    "pgq publish stdin": 2,
    "publish with dedupe keys": 2,
    "pgq publish --dedupe-key": 1,
}
"""How many messages each of `producer_refusals`' operations publishes."""


def test_exactly_the_producer_privileges_publish_in_every_way(orders, as_role):
    assert producer_refusals(as_role("producer")) == set()
    total = sum(PUBLISHED.values())
    assert messages(orders) == total
    for group in ("billing", "shipping"):  # a row in each group for each message
        assert pgq.status(orders, group)["counts"]["ready"] == total


@pytest.mark.parametrize("without", everything("producer"), ids="-".join)
def test_each_producer_privilege_is_needed(orders, as_role, without):
    refused = producer_refusals(as_role("producer", without))
    assert refused, f"a producer without {without} did its whole job"
    # what was refused published nothing
    assert messages(orders) == sum(n for what, n in PUBLISHED.items() if what not in refused)


# -- the administrator's list is exact -----------------------------------------------


@pytest.fixture
def dead_ids(orders: Engine) -> list[int]:
    """Three dead rows of group `billing` (their handler raised `PermanentError`); and a
    group `leaving` on the same topic and a topic `spare` without groups, for the
    administrator to remove."""
    pgq.subscribe(orders, "leaving", "orders")
    pgq.create_topic(orders, "spare")
    pgq.publish(orders, "spare", {"n": 0})
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])

    def refuse(msg: pgq.Message) -> None:
        raise pgq.PermanentError("no")

    pgq.Consumer(orders, "billing", refuse, **FAST).run(until_empty=True)
    assert pgq.status(orders, "billing")["counts"]["dead"] == 3
    return ids


def admin_refusals(role: Role, ids: list[int]) -> set[str]:
    """Everything an administrator does, as `role`: the operations the database refused."""
    eng = role.engine
    work: dict[str, Callable[[], object]] = {
        "status": lambda: monitor.status(eng, "billing"),
        "status of every group": lambda: monitor.status_all(eng),
        "members": lambda: monitor.members(eng, "billing"),
        "breaker": lambda: monitor.breaker_info(eng, "billing"),
        "dead": lambda: monitor.dead(eng, "billing"),
        "check": lambda: monitor.check(eng, "billing"),
        "requeue ids": lambda: requeue(eng, "billing", [ids[0]], reason="roles"),
        "requeue class": lambda: requeue(
            eng, "billing", all_dead=True, error_class="permanent", reason="roles"
        ),
        "requeue all": lambda: requeue(eng, "billing", all_dead=True, reason="roles"),
        "purge": lambda: purge(eng, "billing", reason="roles"),
        "purge older": lambda: purge(eng, "billing", older_than=3600, reason="roles"),
        "show": lambda: monitor.message(eng, "billing", ids[0]),
        "audit": lambda: monitor.audit(eng, "billing"),
        "topics": lambda: pgq.topics(eng),
        # `pgq web`'s sampler: the minute's chart sample of each group (decision 0045)
        "dashboard samples": lambda: sample_every_group(eng),
        "unsubscribe": lambda: pgq.unsubscribe(eng, "leaving", reason="roles"),
        "topic delete": lambda: pgq.delete_topic(eng, "spare", reason="roles"),
    }
    refused = set()
    for what, do in work.items():
        try:
            do()
        except PermissionDenied:
            refused.add(what)
    return refused


def test_exactly_the_admin_privileges_do_every_admin_command(orders, as_role, dead_ids):
    assert admin_refusals(as_role("admin"), dead_ids) == set()
    trail = monitor.audit(orders, "billing")
    # the requeue of all and the purges found nothing: no audit row (issue 21)
    assert [(a["action"], a["count"]) for a in reversed(trail)] == [("requeue", 1), ("requeue", 2)]
    [removed] = monitor.audit(orders, "leaving")
    assert (removed["action"], removed["count"]) == ("unsubscribe", 3)
    [deleted] = monitor.audit(orders, None, topic="spare")
    assert (deleted["action"], deleted["count"]) == ("delete-topic", 1)


@pytest.mark.parametrize("without", everything("admin"), ids="-".join)
def test_each_admin_privilege_is_needed(orders, as_role, dead_ids, without):
    refused = admin_refusals(as_role("admin", without), dead_ids)
    assert refused, f"an administrator without {without} did every admin command"


def test_select_on_every_table_is_enough_to_inspect(orders, as_role, dead_ids, schema):
    """Decision 0018: the read-only commands need nothing but SELECT (and USAGE on
    the schema); a monitoring role needs no admin grant."""
    role = as_role(None)
    with orders.begin() as conn:
        who = sql.Identifier(role.name).as_string(None)
        conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA "{schema}" TO {who}')
        conn.exec_driver_sql(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {who}')
    changes = {"requeue ids", "requeue class", "requeue all", "purge", "purge older"}
    refused = changes | {"unsubscribe", "topic delete", "dashboard samples"}
    assert admin_refusals(role, dead_ids) == refused
    assert pgq.status(orders, "billing")["counts"]["dead"] == 3


def test_the_consumer_role_inspects_all_but_show_and_audit(orders, as_role, dead_ids):
    """Decision 0018: a cron host can check the group it drains with the consumer's
    grants; it cannot requeue, purge, nor read the audit trail."""
    refused = admin_refusals(as_role("consumer"), dead_ids)
    assert refused == {
        "requeue ids",
        "requeue class",
        "requeue all",
        "purge",
        "purge older",
        "show",
        "audit",
        "unsubscribe",
        "topic delete",
    }


# -- pgq grant -----------------------------------------------------------------------


def test_print_prints_what_grant_runs_and_runs_nothing(orders, pg_dsn, schema, pgq_env):
    with login_role(pg_dsn) as (printed, _), login_role(pg_dsn) as (ran, _):
        result = invoke(pgq_env, "grant", printed, "--consumer", "--print")
        assert result.exit_code == 0, result.output
        assert granted(pg_dsn, schema, printed) == set()  # nothing ran
        lines = result.output.splitlines()
        assert lines == grant_sql(schema, printed, "consumer")
        statements = grant(orders, ran, "consumer")
        assert statements == grant_sql(schema, ran, "consumer")
        # the printed text, run as it is, grants what pgq grant granted
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for line in lines:
                conn.execute(line.encode())
        assert granted(pg_dsn, schema, printed) == granted(pg_dsn, schema, ran)
        assert granted(pg_dsn, schema, ran) == set(everything("consumer"))


def test_print_needs_no_database_nor_an_existing_role(schema):
    nowhere = {"PGQ_DSN": "postgresql://nobody@127.0.0.1:1/none", "PGQ_SCHEMA": schema}
    result = invoke(nowhere, "grant", "app_that_will_exist", "--producer", "--print")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f'GRANT USAGE ON SCHEMA "{schema}" TO "app_that_will_exist"',
        f'GRANT SELECT ON TABLE "{schema}"."topic" TO "app_that_will_exist"',
        f'GRANT UPDATE ("created_at") ON TABLE "{schema}"."topic" TO "app_that_will_exist"',
        f'GRANT INSERT ON TABLE "{schema}"."message" TO "app_that_will_exist"',
        f'GRANT SELECT ("id") ON TABLE "{schema}"."message" TO "app_that_will_exist"',
        f'GRANT SELECT ("topic_id") ON TABLE "{schema}"."message" TO "app_that_will_exist"',
        f'GRANT SELECT ("dedupe_key") ON TABLE "{schema}"."message" TO "app_that_will_exist"',
        f'GRANT SELECT ON TABLE "{schema}"."consumer_group" TO "app_that_will_exist"',
        f'GRANT INSERT ON TABLE "{schema}"."delivery" TO "app_that_will_exist"',
    ]
    other = invoke({**nowhere, "PGQ_SCHEMA": "other_schema"}, "grant", "a", "--admin", "--print")
    assert other.exit_code == 0 and '"other_schema"."audit"' in other.output


def test_grant_is_idempotent(orders, pg_dsn, schema, pgq_env):
    with login_role(pg_dsn) as (name, _):
        first = invoke(pgq_env, "grant", name, "--admin")
        again = invoke(pgq_env, "grant", name, "--admin")
        assert first.exit_code == again.exit_code == 0, again.output
        assert first.output == again.output
        assert granted(pg_dsn, schema, name) == set(everything("admin"))
        # another job adds to what the role has; nothing is taken away
        assert invoke(pgq_env, "grant", name, "--producer").exit_code == 0
        assert granted(pg_dsn, schema, name) == set(everything("admin")) | set(
            everything("producer")
        )


def grant_at_once(engines: list[Engine], names: list[str], job: str) -> list[str]:
    """`grant(engine, name, job)` for each pair, in threads started together: how
    each one that raised failed."""
    start = threading.Barrier(len(names))
    failures: list[str] = []

    def run(eng: Engine, name: str) -> None:
        start.wait(10)
        try:
            grant(eng, name, job)
        except Exception as exc:
            failures.append(f"{name}: {exc!r}")

    threads = [
        threading.Thread(target=run, args=pair, daemon=True)
        for pair in zip(engines, names, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a grant hung"
    return failures


def test_concurrent_grants_all_succeed(orders, pg_dsn, schema):
    """Deployments run `pgq grant` as services start, several at once. Failed on
    d54e659: two GRANTs on one table at once, and one of them failed with "tuple
    concurrently updated"."""
    with contextlib.ExitStack() as stack:
        names = [stack.enter_context(login_role(pg_dsn))[0] for _ in range(6)]
        engines = [pgq.connect(pg_dsn, schema=schema) for _ in names]
        for eng in engines:
            stack.callback(eng.dispose)
            with eng.connect():  # connected before the start: the grants overlap
                pass
        for _ in range(4):
            assert grant_at_once(engines, names, "consumer") == []
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                for name in names:
                    assert granted(pg_dsn, schema, name) == set(everything("consumer"))
                    conn.execute(
                        sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(
                            sql.Identifier(schema), sql.Identifier(name)
                        )
                    )


def test_a_hostile_role_name_is_one_quoted_identifier(orders, pg_dsn, schema, pgq_env):
    with orders.begin() as conn:
        conn.exec_driver_sql(f'CREATE TABLE "{schema}".y (n int)')
    hostile = f'x"; DROP TABLE {schema}.y; --'
    with login_role(pg_dsn, hostile) as (name, dsn):
        printed = invoke(pgq_env, "grant", name, "--producer", "--print")
        result = invoke(pgq_env, "grant", name, "--producer")
        assert result.exit_code == 0, result.output
        assert result.output == printed.output
        assert f'TO "x""; DROP TABLE {schema}.y; --"' in result.output.splitlines()[0]
        assert granted(pg_dsn, schema, name) == set(everything("producer"))
        with orders.connect() as conn:  # still there
            assert conn.exec_driver_sql(f'SELECT count(*) FROM "{schema}".y').scalar() == 0
        producer = pgq.connect(dsn, schema=schema)
        try:
            assert pgq.publish(producer, "orders", {"n": 1}) > 0
        finally:
            producer.dispose()


@pytest.mark.parametrize(
    ("role", "says"),
    [
        ("", "give the name of an existing role"),
        ("a\nb", "printable characters only"),
        ("a\x1b[31mb", "printable characters only"),
        ("a\u202eb", "printable characters only"),
        ("a\x00b", "printable characters only"),
        ("a" * 64, "at most 63 bytes"),
        ("é" * 32, "at most 63 bytes"),
        ("public", "reserved by PostgreSQL"),
        ("none", "reserved by PostgreSQL"),
        ("pg_monitor", "reserved by PostgreSQL"),
    ],
    ids=["empty", "newline", "escape", "bidi", "nul", "long", "long-utf8", "public", "none", "pg"],
)
@pytest.mark.parametrize("printing", [False, True], ids=["grant", "print"])
def test_a_role_name_that_cannot_be_one_identifier_is_refused(
    orders, pg_dsn, schema, pgq_env, role, says, printing
):
    args = ["grant", role, "--consumer", *(["--print"] if printing else [])]
    line = one_error_line(invoke(pgq_env, *args))
    assert says in line
    with psycopg.connect(pg_dsn) as conn:  # PUBLIC was granted nothing
        acl = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,"
            " aclexplode(c.relacl) a WHERE n.nspname = %s AND a.grantee = 0",
            [schema],
        ).fetchone()
    assert acl == (0,)


@settings(
    max_examples=int(os.environ.get("CLI_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(role=st.text(max_size=70) | st.sampled_from(['x"; DROP TABLE y; --', "a b", "%s", "{}"]))
def test_any_role_name_is_one_quoted_identifier_or_refused(orders, pg_dsn, schema, pgq_env, role):
    printed = invoke(pgq_env, "grant", role, "--admin", "--print")
    if printed.exit_code == 0:
        quoted = '"' + role.replace('"', '""') + '"'
        lines = printed.output.splitlines()
        assert len(lines) == 1 + len(ADMIN_TABLES)
        assert all(line.startswith("GRANT ") and line.endswith(f" TO {quoted}") for line in lines)
        assert lines == grant_sql(schema, role, "admin")
    else:
        one_error_line(printed)
    # no such role: refused, whatever the name, and nothing is granted to anyone
    one_error_line(invoke(pgq_env, "grant", role, "--admin"))
    with psycopg.connect(pg_dsn) as conn:
        acl = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,"
            " aclexplode(c.relacl) a WHERE n.nspname = %s AND a.grantee <> c.relowner",
            [schema],
        ).fetchone()
    assert acl == (0,)


@pytest.mark.parametrize(
    "flags",
    [(), ("--print",), ("--producer", "--consumer"), ("--producer", "--consumer", "--admin")],
    ids=["none", "none-print", "two", "three"],
)
def test_exactly_one_job_flag(orders, pgq_env, flags):
    line = one_error_line(invoke(pgq_env, "grant", "app", *flags))
    assert "give exactly one of --producer, --consumer, --admin" in line


def test_a_role_that_does_not_exist_is_refused(orders, pgq_env, pg_dsn, schema):
    line = one_error_line(invoke(pgq_env, "grant", "no_such_role_here", "--producer"))
    assert "role 'no_such_role_here' does not exist" in line


def test_grant_before_init_is_refused(pg_dsn, pgq_env, schema):
    with login_role(pg_dsn) as (name, _):
        line = one_error_line(invoke(pgq_env, "grant", name, "--consumer"))
    assert f"schema {schema} is not installed" in line and "pgq init" in line


@pytest.mark.parametrize("job", ["producer", "consumer"])
def test_only_the_owner_can_grant(granted_roles, orders, pg_dsn, schema, job):
    """The producer role grants another role: its own privileges it holds without
    the grant option (PostgreSQL only warns, "no privileges were granted"), the
    consumer's it lacks (PostgreSQL refuses). Exit 2 either way; nothing granted."""
    producer = granted_roles["producer"]
    with login_role(pg_dsn) as (name, _):
        line = one_error_line(invoke(producer.env, "grant", name, f"--{job}"))
        assert f"run pgq grant as the owner of schema {schema}" in line
        assert line.endswith("nothing granted")
        if job == "producer":
            assert f"role {producer.name!r} cannot grant USAGE on schema {schema};" in line
        else:
            assert "permission denied" in line
        assert granted(pg_dsn, schema, name) == set()


def test_the_owner_that_ran_init_grants_the_others(pg_dsn, schema, pgq_env):
    """The README's roles: an owner (not a superuser) migrates and grants; the
    producer it granted publishes."""
    with login_role(pg_dsn) as (owner, owner_dsn), login_role(pg_dsn) as (app, app_dsn):
        dbname = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                    sql.Identifier(str(dbname)), sql.Identifier(owner)
                )
            )
        as_owner = {**pgq_env, "PGQ_DSN": owner_dsn}
        for args in (("init",), ("topic", "create", "orders"), ("subscribe", "billing", "orders")):
            assert invoke(as_owner, *args).exit_code == 0, args
        result = invoke(as_owner, "grant", app, "--producer")
        assert result.exit_code == 0, result.output
        proc = run_pgq({**pgq_env, "PGQ_DSN": app_dsn}, "publish", "orders", '{"n": 1}')
        assert proc.returncode == 0, proc.stderr
        eng = pgq.connect(owner_dsn, schema=schema)
        try:
            assert pgq.status(eng, "billing")["counts"]["ready"] == 1
        finally:
            eng.dispose()


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("consume", "billing", "--handler", "handlers:record", "--until-empty"), "USAGE on"),
        (("publish", "orders", '{"n": 1}'), "USAGE on"),
        (("status", "billing"), "permission denied for schema"),
        (("requeue", "billing", "--all", "--reason", "r"), "permission denied for schema"),
        (("purge", "billing", "--dead", "--reason", "r"), "permission denied for schema"),
        (("grant", "someone", "--consumer"), ""),
    ],
    ids=["consume", "publish", "status", "requeue", "purge", "grant"],
)
def test_a_role_with_no_grants_is_exit_2_naming_what_it_lacks(
    orders, as_role, tmp_path, schema, args, names
):
    role = as_role(None)
    proc = run_pgq(consumer_env(role.env, tmp_path), *args)
    line = assert_one_line_exit_2(proc)
    assert names in line
    if args[0] == "consume":
        assert f"lacks privileges a consumer needs: USAGE on schema {schema};" in line
    assert pgq.status(orders, "billing")["counts"] == {
        "ready": 0,
        "leased": 0,
        "done": 0,
        "dead": 0,
        "dead_systemic": 0,
    }
    assert monitor.audit(orders, "billing") == []
