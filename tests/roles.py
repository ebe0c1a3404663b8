"""Login roles for the privilege tests: bare, with part of a job's privileges, or
left for `pgq grant` to fill.

`login_role(pg_dsn)` creates a role unique to the run with no privileges and
yields its name and a DSN that logs in as it. `job_role(pg_dsn, schema, job,
without=...)` grants it, by hand, every privilege `job` needs on `schema` (the
lists of `pgq.sql.privileges`) except those in `without`; `consumer_role` is
that for a consumer. At the end the role's sessions are ended, its grants
revoked (DROP OWNED BY) and the role dropped, also when the test failed.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator

import psycopg
from psycopg import sql

from pgq.sql.privileges import JOBS, grant_statement

PASSWORD = "pgq-role-password"
"""Every role made here logs in with this (a server may ask for one)."""


def everything(job: str) -> tuple[tuple[str, str], ...]:
    """Every (object, privilege) `job` needs, `("schema", "USAGE")` first:
    `without=everything(job)` grants nothing."""
    return tuple(JOBS[job].objects())


EVERYTHING = everything("consumer")
"""Every (object, privilege) a consumer needs: `without=EVERYTHING` grants nothing."""


def grant_statements(
    schema: str, role: str, without: Iterable[tuple[str, str]], job: str = "consumer"
) -> list[sql.Composed]:
    """GRANT statements for what `job` needs on `schema`, except `without`."""
    skip = set(without)
    need = JOBS[job]
    grants = []
    if ("schema", "USAGE") not in skip:
        grants.append(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
    for kind, objects in (("TABLE", need.tables), ("SEQUENCE", need.sequences)):
        for name, privileges in objects.items():
            wanted = [p for p in privileges if (name, p) not in skip]
            if wanted:
                grants.append(grant_statement(kind, schema, name, wanted, role))
    return grants


def unique_role_name(prefix: str = "pgq_role") -> str:
    """A role name no other test or run uses."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def dropped_afterwards(pg_dsn: str, name: str) -> Iterator[None]:
    """At the end: end role `name`'s sessions, revoke what it was granted in this
    database and drop it, if it exists (also when the test failed)."""
    try:
        yield
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [name]).fetchone():
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    [name],
                )
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@contextlib.contextmanager
def login_role(pg_dsn: str, name: str | None = None) -> Iterator[tuple[str, str]]:
    """A login role with no privileges (named `name`, else a unique name): yields
    (its name, a DSN that logs in as it); dropped at the end."""
    name = name or unique_role_name()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(name), sql.Literal(PASSWORD)
            )
        )
    with dropped_afterwards(pg_dsn, name):
        yield name, psycopg.conninfo.make_conninfo(pg_dsn, user=name, password=PASSWORD)


@contextlib.contextmanager
def job_role(
    pg_dsn: str, schema: str, job: str, without: Iterable[tuple[str, str]] = ()
) -> Iterator[tuple[str, str]]:
    """A login role with `job`'s privileges on `schema` minus `without`, granted by
    hand: yields (its name, a DSN that logs in as it)."""
    with login_role(pg_dsn) as (name, dsn):
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for statement in grant_statements(schema, name, without, job):
                admin.execute(statement)
        yield name, dsn


def consumer_role(
    pg_dsn: str, schema: str, without: Iterable[tuple[str, str]] = ()
) -> contextlib.AbstractContextManager[tuple[str, str]]:
    """A login role with a consumer's privileges on `schema` minus `without`:
    yields (its name, a DSN that logs in as it)."""
    return job_role(pg_dsn, schema, "consumer", without)
