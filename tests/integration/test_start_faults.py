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


def test_a_drained_run_counts_the_retries_it_left_even_once_they_came_due(orders, pg_dsn, schema):
    """`until_empty` ends with a row waiting for a retry: the summary counts it as left
    for a later run. Before: the count was read again by the final pass, and a retry
    that had come due by then counted nowhere (a run under load "left nothing" while
    rows it never finished were ready; 21 of 6,000 in a loaded CI run). Here the final
    pass waits, on the member's row, until the retry is due."""
    mid = pgq.publish(orders, "orders", {"n": 1})
    holder = psycopg.connect(pg_dsn)
    calls: list[int] = []
    locked = threading.Event()

    def handler(msg: pgq.Message) -> None:
        calls.append(msg.id)
        if len(calls) == 1:  # from now on leaving the group waits for this session
            holder.execute(f'SELECT 1 FROM "{schema}".member FOR UPDATE')
            locked.set()
        raise pgq.RetryLater(0.5)

    consumer = pgq.Consumer(orders, "billing", handler, **FAST)
    out: list[pgq.RunSummary] = []
    runner = threading.Thread(target=lambda: out.append(consumer.run(until_empty=True)))
    try:
        runner.start()
        assert locked.wait(WAIT), "the handler was not called"
        due = (
            f'SELECT available_at <= now() FROM "{schema}".delivery'
            " WHERE message_id = %s AND state = 'ready'"
        )
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            wait_until(
                lambda: (watch.execute(due, (mid,)).fetchone() or [False])[0],
                WAIT,
                "the snoozed row to come due",
                describe=lambda: watch.execute(
                    f'SELECT state, available_at, now() FROM "{schema}".delivery'
                ).fetchall(),
            )
        holder.rollback()
        runner.join(WAIT)
        assert not runner.is_alive(), "the run did not end"
    finally:
        holder.close()
    (summary,) = out
    assert summary.stop_reason == "empty" and calls == [mid]
    assert summary.waiting_retry == 1, summary
