"""The `pgbouncer` fixture (tests/fixtures/pgbouncer.py), and the failure that makes pgq
need a `session_dsn` and no prepared statements through a transaction-mode pooler."""

from __future__ import annotations

import psycopg
import pytest


def test_a_plain_connection_runs_through_the_pooler(pgbouncer):
    with psycopg.connect(pgbouncer.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        database = conn.execute("SELECT current_database()").fetchone()
    with psycopg.connect(pgbouncer.direct_dsn) as direct:
        assert database == direct.execute("SELECT current_database()").fetchone()
    config = {row["key"]: row["value"] for row in pgbouncer.show("CONFIG")}
    assert config["pool_mode"] == "transaction"


def test_psycopgs_prepared_statements_break_when_another_client_takes_their_server(pgbouncer):
    """What today's pgq meets through PgBouncer 1.18 in transaction mode: psycopg
    prepares a statement on its 6th run (`prepare_threshold=5`), on the server
    connection PgBouncer lent for that transaction. Once another client holds that
    server connection in its transaction, the next run of the statement is lent
    another one, where the statement was never prepared.

    Deterministic: PgBouncer lends the most recently used idle server connection
    (`server_round_robin = 0`), and every step waits for the one before."""
    query = "SELECT pg_backend_pid()"
    with (
        psycopg.connect(pgbouncer.dsn, autocommit=True) as client,
        psycopg.connect(pgbouncer.dsn, autocommit=True) as other,
    ):
        assert client.prepare_threshold == 5  # psycopg's default
        pids = {client.execute(query).fetchone() for _ in range(6)}  # the 6th prepares
        assert len(pids) == 1  # one server connection, reused transaction after transaction

        other.execute("BEGIN")
        assert other.execute(query).fetchone() in pids  # it now holds that server connection
        with pytest.raises(psycopg.errors.InvalidSqlStatementName, match='"_pg3_0" does not exist'):
            client.execute(query)
        other.execute("COMMIT")

    # without prepared statements the same interleaving works
    with (
        psycopg.connect(pgbouncer.dsn, autocommit=True, prepare_threshold=None) as client,
        psycopg.connect(pgbouncer.dsn, autocommit=True) as other,
    ):
        pids = {client.execute(query).fetchone() for _ in range(6)}
        other.execute("BEGIN")
        assert other.execute(query).fetchone() in pids
        assert client.execute(query).fetchone() not in pids
        other.execute("COMMIT")
