"""Real PostgreSQL for every test.

The server comes from `$PGQ_TEST_DSN`, else testcontainers where a Docker
engine answers, else an embedded server started for this run. Each run creates
its own database on that server (dropped at the end), and each test gets its
own freshly migrated schema in it, so tests never see each other's rows.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine

import pgq
from pgq import embedded
from pgq.connect import connect

_schemas = itertools.count()


def _docker_answers() -> bool:
    """True when a Docker engine answers on its socket (`$DOCKER_HOST` or the default)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True  # a remote engine: let testcontainers try it
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(host[len("unix://") :])
            sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in sock.recv(256)
    except OSError:
        return False


@contextlib.contextmanager
def _server() -> Iterator[str]:
    """A libpq URL of a server this run may create databases on."""
    env = os.environ.get("PGQ_TEST_DSN")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as pg:
            yield pg.get_connection_url()
        return
    home = Path(tempfile.mkdtemp(prefix="pgq-test-pg-"))
    try:
        yield embedded.ensure_running(home)
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)


def with_dbname(dsn: str, dbname: str) -> str:
    """`dsn` pointed at database `dbname`."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**params)


@pytest.fixture(autouse=True)
def _restore_pgq_logger() -> Iterator[None]:
    """The CLI configures the `pgq` logger; in-process CLI runs must not leak that."""
    logger = logging.getLogger("pgq")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """A libpq connection string to a database created for this test run."""
    with _server() as server:
        dbname = f"pgq_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        try:
            yield with_dbname(server, dbname)
        finally:
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(dbname)
                    )
                )


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A fresh, empty schema name for this test (dropped afterwards)."""
    name = f"t{os.getpid()}_{next(_schemas)}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def engine(pg_dsn: str, schema: str) -> Iterator[Engine]:
    """An engine on this test's schema, migrated."""
    eng = connect(pg_dsn, schema=schema)
    pgq.migrate(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def pgq_env(pg_dsn: str, schema: str) -> dict[str, str]:
    """Environment for a `pgq` subprocess on this test's database and schema."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(PGQ_DSN=pg_dsn, PGQ_SCHEMA=schema)
    return env
