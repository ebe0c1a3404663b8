"""`pgq init` upgrades a database in use, built by the previous version, and it drains.

`tests/fixtures/schemas/v1.sql` is the schema version 1 created as released
(pg_dump of `pgq init` at fcf4473). The test restores it, leaves the rows an
outage leaves behind in it (ready, leased by a member that died, waiting for a
retry, dead of the outage, dead for real), upgrades it with today's `pgq init`
while the group's breaker is OPEN, and drains it with one cron-style run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import FAST
from sqlalchemy import Engine, text

import pgq
from pgq import monitor
from pgq.store.migrations import LATEST

V1 = Path(__file__).parent.parent / "fixtures" / "schemas" / "v1.sql"


@pytest.fixture
def v1(pg_dsn: str, schema: str) -> Iterator[Engine]:
    """The test's schema at version 1 as released, with group `g` on topic `t`."""
    ddl = V1.read_text().replace("pgq_v1_schema", f'"{schema}"')
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(ddl)
        conn.execute(f'INSERT INTO "{schema}".schema_version (version) VALUES (1)')
    engine = pgq.connect(pg_dsn, schema=schema)
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    yield engine
    engine.dispose()


def sql(engine: Engine, statement: str, **params: object) -> None:
    with engine.begin() as conn:
        conn.execute(text(statement), params)


def test_init_upgrades_a_version_1_database_in_use_and_it_drains(v1: Engine, schema: str):
    s = f'"{schema}".delivery'
    ids = pgq.publish_many(v1, "t", [{"i": i} for i in range(40)])
    ready, leased, retrying, outage, poison = (ids[i : i + 8] for i in range(0, 40, 8))
    # what version 1 left: a member died holding leases; retries waiting (a message
    # failure, and a snooze after a systemic failure, which version 1 kept systemic);
    # an outage (epoch 1, still OPEN) killed rows; real dead letters
    sql(v1, f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = 1, next_probe_at = now()")
    sql(
        v1,
        f"UPDATE {s} SET state = 'leased', lease_owner = 'gone', lease_seq = nextval("
        f"'\"{schema}\".lease_token'), lease_expires_at = now() - interval '1 second'"
        " WHERE message_id = ANY(:ids)",
        ids=leased,
    )
    sql(
        v1,
        f"UPDATE {s} SET attempts = 1, error_class = 'message', last_error = 'ValueError',"
        " error_epoch = 0, available_at = now() + interval '2 seconds'"
        " WHERE message_id = ANY(:ids)",
        ids=retrying[:4],
    )
    sql(
        v1,
        f"UPDATE {s} SET attempts = 1, refundable_attempts = 1, error_class = 'systemic',"
        " error_epoch = 0, available_at = now() + interval '2 seconds'"
        " WHERE message_id = ANY(:ids)",
        ids=retrying[4:],
    )
    sql(
        v1,
        f"UPDATE {s} SET state = 'dead', attempts = 3, refundable_attempts = 3,"
        " error_class = 'systemic', last_error = 'ConnectionError', error_epoch = 0"
        " WHERE message_id = ANY(:ids)",
        ids=outage,
    )
    sql(
        v1,
        f"UPDATE {s} SET state = 'dead', attempts = 3, error_class = 'message',"
        " last_error = 'ValueError', error_epoch = 0 WHERE message_id = ANY(:ids)",
        ids=poison,
    )

    assert pgq.migrate(v1) == LATEST
    assert pgq.migrate(v1) == LATEST  # idempotent
    with v1.connect() as conn:
        versions = conn.execute(text(f'SELECT version FROM "{schema}".schema_version')).scalars()
        assert sorted(versions) == list(range(1, LATEST + 1))
        assert conn.execute(text(f"SELECT to_regclass('\"{schema}\".delivery_charged_idx')"))
    state, line = monitor.check(v1, "g")
    assert (state, line.split(";")[0]) == ("CRITICAL", "CRITICAL: 8 dead rows (8 message)")

    handled: list[tuple[int, int]] = []
    consumer = pgq.Consumer(
        v1,
        "g",
        lambda m: handled.append((m.id, m.attempt)),
        **FAST,
        lease=5,
        breaker_min_members=1,
    )
    summary = consumer.run(until_empty=True, wait_retries=10)
    assert summary.stop_reason == "empty"

    status = pgq.status(v1, "g")
    assert status["breaker"]["state"] == "CLOSED"
    assert status["counts"]["dead"] == len(poison)
    assert status["counts"]["ready"] == status["counts"]["leased"] == 0
    attempts = dict(handled)
    assert sorted(attempts) == sorted(ready + leased + retrying + outage)
    assert all(attempts[i] == 1 for i in ready + leased + outage + retrying[4:])
    assert all(attempts[i] == 2 for i in retrying[:4])
    # the dead member's leases expired while the group was OPEN: charged, refunded too
    assert status["totals"]["refunded"] == len(outage) + len(retrying[4:]) + len(leased)
