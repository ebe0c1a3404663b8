"""Login roles with part of what a consumer needs, for the privilege tests.

`consumer_role(pg_dsn, schema, without=...)` creates a role unique to the run,
grants it every privilege a consumer needs on `schema` (the list the member
checks, `pgq.sql.privileges`) except those in `without`, and yields a DSN that
logs in as it. At the end the role's sessions are ended, its grants revoked
(DROP OWNED BY) and the role dropped, also when the test failed.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator

import psycopg
from psycopg import sql

from pgq.sql.privileges import CONSUMER_SEQUENCES, CONSUMER_TABLES

PASSWORD = "pgq-role-password"
"""Every role made here logs in with this (a server may ask for one)."""

EVERYTHING = (
    ("schema", "USAGE"),
    *(
        (name, privilege)
        for objects in (CONSUMER_TABLES, CONSUMER_SEQUENCES)
        for name, privileges in objects.items()
        for privilege in privileges
    ),
)
"""Every (object, privilege) a consumer needs: `without=EVERYTHING` grants nothing."""


def grant_statements(
    schema: str, role: str, without: Iterable[tuple[str, str]]
) -> list[sql.Composed]:
    """GRANT statements for what a consumer needs on `schema`, except `without`."""
    skip = set(without)
    who = sql.Identifier(role)
    grants = []
    if ("schema", "USAGE") not in skip:
        grants.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), who))
    for kind, objects in (("TABLE", CONSUMER_TABLES), ("SEQUENCE", CONSUMER_SEQUENCES)):
        for name, privileges in objects.items():
            wanted = [p for p in privileges if (name, p) not in skip]
            if wanted:
                grants.append(
                    sql.SQL("GRANT {} ON {} {} TO {}").format(
                        sql.SQL(", ").join(sql.SQL(p) for p in wanted),
                        sql.SQL(kind),
                        sql.Identifier(schema, name),
                        who,
                    )
                )
    return grants


@contextlib.contextmanager
def consumer_role(
    pg_dsn: str, schema: str, without: Iterable[tuple[str, str]] = ()
) -> Iterator[tuple[str, str]]:
    """A login role with a consumer's privileges on `schema` minus `without`:
    yields (its name, a DSN that logs in as it)."""
    name = f"pgq_role_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(name), sql.Literal(PASSWORD)
            )
        )
        try:
            for statement in grant_statements(schema, name, without):
                admin.execute(statement)
            yield name, psycopg.conninfo.make_conninfo(pg_dsn, user=name, password=PASSWORD)
        finally:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [name],
            )
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
