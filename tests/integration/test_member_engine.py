"""The sessions a consumer member runs on (`pgq.store.member_links`)."""

from __future__ import annotations

import threading
import time

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
    links = pgq.store.member_links(user, "g", "m", idle_in_transaction=5.0)
    try:
        with user.connect() as conn:
            assert conn.exec_driver_sql("SHOW jit").scalar() == "on"
        for link in (links.session, links.claims, links.work):
            with link.engine.connect() as conn:
                assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
                timeout = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
                assert timeout == "5s"
    finally:
        links.close()
        user.dispose()


def test_a_member_vacuums_delivery_when_dead_rows_dominate(engine: Engine, schema: str):
    """Each message leaves ~3 dead row versions in `delivery`; autovacuum looks once a
    minute, so a busy table grew to ~400 MB for ~10,000 live rows. A member that owns
    the table vacuums it itself once dead rows dominate (decision 0021)."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    with engine.begin() as conn:  # autovacuum would leave the member nothing to do
        conn.exec_driver_sql(f'ALTER TABLE "{schema}".delivery SET (autovacuum_enabled = false)')
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


def test_leases_are_extended_while_a_vacuum_runs(engine: Engine, schema: str, monkeypatch):
    """A VACUUM of a big table can take longer than the lease; it runs on a thread of
    its own, so the maintenance thread keeps extending the member's leases (before:
    it ran there, no lease was extended meanwhile, and another member's sweep took
    the rows a running handler held: messages ran twice)."""
    from pgq.store.group import GroupStore

    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    (mid,) = pgq.publish_many(engine, "t", [{"i": 0}])
    vacuum = GroupStore.vacuum_dead_rows

    def slow_vacuum(self: GroupStore, conn: object) -> bool:
        time.sleep(3.0)  # a big table's VACUUM, longer than the 2 s lease
        return vacuum(self, conn)

    monkeypatch.setattr(GroupStore, "vacuum_dead_rows", slow_vacuum)
    running = threading.Event()

    def handler(msg: pgq.Message) -> None:
        running.set()
        time.sleep(4.0)

    consumer = pgq.Consumer(engine, "g", handler, lease=2.0, **FAST)
    consumer.start()
    try:
        assert running.wait(20)
        left = []
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                left.append(
                    conn.exec_driver_sql(
                        "SELECT extract(epoch FROM lease_expires_at - now())"
                        f' FROM "{schema}".delivery WHERE message_id = %(mid)s',
                        {"mid": mid},
                    ).scalar()
                )
            time.sleep(0.1)
        assert min(x for x in left if x is not None) > 0, left
    finally:
        consumer.stop(timeout=30)
