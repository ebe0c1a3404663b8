"""The sessions a consumer member runs on (`pgq.store.member_engine`)."""

from __future__ import annotations

import psycopg
from helpers import FAST, wait_until
from sqlalchemy import Engine

import pgq
from pgq.store import conninfo_of


def test_member_sessions_run_without_jit_whatever_the_dsn_says(engine: Engine, schema: str):
    """With JIT on, the planner compiled the drain check of `until_empty` (its cost
    estimate crosses jit_above_cost) for ~0.6 s at the end of every drain, for a
    statement that runs in 2 ms; member sessions turn JIT off, also over a DSN
    whose own options turn it on."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo_of(engine))
    params["options"] = "-c jit=on -c jit_above_cost=0"
    user = pgq.connect(psycopg.conninfo.make_conninfo("", **params), schema=schema)
    member = pgq.store.member_engine(user, idle_in_transaction=5.0, connections=1)
    try:
        with user.connect() as conn:
            assert conn.exec_driver_sql("SHOW jit").scalar() == "on"
        with member.connect() as conn:
            assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
            timeout = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
            assert timeout == "5s"
    finally:
        member.dispose()
        user.dispose()


def test_a_member_vacuums_delivery_when_dead_rows_dominate(engine: Engine, schema: str):
    """Each message leaves ~3 dead row versions in `delivery`; autovacuum looks once a
    minute, so a busy table grew to ~400 MB for ~10,000 live rows. A member that owns
    the table vacuums it itself once dead rows dominate (decision 0021)."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    for start in range(0, 30_000, 5_000):
        pgq.publish_many(engine, "t", [{"i": i} for i in range(start, start + 5_000)])

    def vacuums() -> int:
        with engine.connect() as conn:
            return int(
                conn.exec_driver_sql(
                    "SELECT vacuum_count FROM pg_stat_user_tables"
                    " WHERE relid = to_regclass(%(rel)s)",
                    {"rel": f'"{schema}".delivery'},
                ).scalar()
            )

    before = vacuums()
    consumer = pgq.Consumer(engine, "g", lambda m: None, prefetch="adaptive", **FAST)
    consumer.start()
    try:
        wait_until(lambda: vacuums() > before, 60, "the member's VACUUM of delivery")
    finally:
        consumer.stop(timeout=30)
