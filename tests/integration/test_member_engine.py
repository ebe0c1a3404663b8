"""The sessions a consumer member runs on (`pgq.store.member_engine`)."""

from __future__ import annotations

import psycopg
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
