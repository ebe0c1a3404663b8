"""A member whose connections are cut while it joins (DESIGN §4, §7: a database that
cannot be reached at start is retried with backoff; with `until_empty` the run gives
up only after `lease` seconds, and then exits 75 — never a traceback out of `run`).

The cut is placed exactly: a session of the test holds the `member` table, so the
member's join waits on that lock, and the proxy cuts every connection while it waits.
"""

from __future__ import annotations

import threading

import psycopg
from chaos.proxy import Proxy
from helpers import FAST, wait_until

import pgq

WAIT = 30.0


def test_a_join_cut_by_the_network_is_retried(orders, pg_dsn, schema):
    """Before: `run(until_empty=True)` raised `DatabaseUnavailable` out of the join."""
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])
    handled: list[int] = []
    holder = psycopg.connect(pg_dsn)
    try:
        holder.execute(f'LOCK TABLE "{schema}".member IN ACCESS EXCLUSIVE MODE')
        with Proxy.for_dsn(pg_dsn) as proxy:
            through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
            consumer = pgq.Consumer(
                through, "billing", lambda m: handled.append(m.id), lease=10.0, **FAST
            )
            out: list[object] = []

            def run() -> None:
                try:
                    out.append(consumer.run(until_empty=True))
                except Exception as exc:  # what the test reports, not a thread's crash
                    out.append(exc)

            runner = threading.Thread(target=run)
            runner.start()
            joining = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE 'INSERT INTO%%member%%' AND pid <> pg_backend_pid()"
            )
            with psycopg.connect(pg_dsn, autocommit=True) as watch:
                wait_until(
                    lambda: watch.execute(joining).fetchone()[0] > 0,  # type: ignore[index]
                    WAIT,
                    "the member's join to wait on the member table",
                )
            proxy.cut()
            holder.rollback()  # the table is free again: the retried join goes through
            runner.join(WAIT)
            through.dispose()
        assert not runner.is_alive(), "the run did not end"
    finally:
        holder.close()
    (summary,) = out
    assert isinstance(summary, pgq.RunSummary), summary
    assert summary.stop_reason == "empty"
    assert summary.done == 3 and sorted(set(handled)) == sorted(handled)
    assert pgq.status(orders, "billing")["counts"]["done"] == 3
