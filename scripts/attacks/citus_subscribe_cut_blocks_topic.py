"""A subscribe whose two-phase commit is cut after `PREPARE TRANSACTION` on a worker (the
coordinator committed; the worker keeps the prepared part until Citus's recovery,
`citus.recover_2pc_interval`, 1 min here) blocks every later subscribe of the schema,
and with it the publishing and retention of the later subscribe's topic.

A subscriber session subscribes new groups `s<n>` to topic `a`, while a thread terminates
that session's backends on each worker once they sit idle after `PREPARE TRANSACTION`;
it stops once one subscribe is left prepared on a worker (>100 ms; the subscribe returned).
Then, timed (bounded at 20 s, after which `recover_prepared_transactions()` lets them
through): a subscribe of group `next` to another topic `b`, and 0.3 s later a publish to
`b` and a publish to `a`.

The loop's own subscribes are timed too: the one after a cut one may already wait (then
the pending transaction is gone by the time it returns, and that wait is the finding).

Expected: they answer promptly (the earlier subscribe did commit, as far as pgq knows).
Observed: printed; exit 1 when one waited until the prepared transaction was recovered.
Seen in `citus_subscribe_race.py ATK_CUT=1`: a subscribe waiting 43 s in
`lock_shard_resources(7, ...)` on 9702 (the shard lock of the reference table
`consumer_group`) while its topic's publishers and retention queued on the topic's
advisory lock behind it.
"""

from __future__ import annotations

import os
import threading
import time

import psycopg
from citus_common import DSN, CitusSchema, node_dsn, node_sql, verdict
from sqlalchemy import text

import pgq

SECONDS = float(os.environ.get("ATK_SECONDS", "40"))
BOUND = 20.0


def main() -> None:
    problems: list[str] = []
    with CitusSchema("subcut") as s:
        pgq.create_topic(s.engine, "a")
        pgq.create_topic(s.engine, "b")
        sub = s.engine.connect()
        cpid = sub.execute(text("SELECT pg_backend_pid()")).scalar()
        sub.commit()
        app = f"citus_internal gpid={10_000_000_000 + int(cpid)}"
        prefix = f"citus_0_{cpid}_"
        stop = threading.Event()

        def killer(port: int) -> None:
            with psycopg.connect(node_dsn(port), autocommit=True) as w:
                while not stop.is_set():
                    w.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name = %s AND state = 'idle'"
                        " AND query LIKE 'PREPARE TRANSACTION%%'",
                        (app,),
                    )

        ths = [threading.Thread(target=killer, args=(p,), daemon=True) for p in s.workers()]
        for th in ths:
            th.start()
        pending: list[tuple] = []
        n = 0
        deadline = time.monotonic() + SECONDS
        durations: list[tuple[float, str]] = []
        while time.monotonic() < deadline and not pending:
            began = time.monotonic()
            try:
                with sub.begin():
                    pgq.subscribe(sub, f"s{n}", "a")
            except Exception:
                try:
                    sub.rollback()
                except Exception:
                    pass
            durations.append((round(time.monotonic() - began, 2), f"s{n}"))
            n += 1
            for p in s.workers():
                got = node_sql(
                    p,
                    "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s"
                    " AND prepared < now() - interval '100 ms'",
                    (prefix + "%",),
                )
                pending += [(p, g[0]) for g in got]
        stop.set()
        for th in ths:
            th.join()
        sub.close()
        print(
            f"subscribes tried {n} (seconds each: {durations}); prepared, not committed: {pending}"
        )
        slow = [d for d in durations if d[0] > 10]
        if slow and not pending:  # the one after a cut waited for the recovery itself
            problems.append(f"subscribes of the loop waited for the recovery of a cut one: {slow}")
            stop.set()
            verdict(problems, "a cut subscribe does not block later subscribes and publishes")
        if not pending:
            verdict([], "subscribe after a cut subscribe (window not reached this run)")
        took: dict[str, float] = {}
        errs: dict[str, str] = {}
        other = pgq.connect(DSN, schema=s.name)

        def timed(name, fn) -> None:
            t0 = time.monotonic()
            try:
                fn()
            except Exception as exc:
                errs[name] = f"{type(exc).__name__}: {exc}"
            took[name] = time.monotonic() - t0

        jobs = {
            "subscribe next->b": lambda: pgq.subscribe(s.engine, "next", "b"),
            "publish b": lambda: pgq.publish(other, "b", {"x": 1}),
            "publish a": lambda: pgq.publish(other, "a", {"x": 1}),
        }
        threads = [threading.Thread(target=timed, args=(k, f)) for k, f in jobs.items()]
        for t_ in threads:
            t_.start()
            time.sleep(0.3)
        until = time.monotonic() + BOUND
        for t_ in threads:
            t_.join(timeout=max(0.0, until - time.monotonic()))
        blocked = [k for k, t_ in zip(jobs, threads, strict=True) if t_.is_alive()]
        waits = node_sql(
            9702,
            "SELECT left(query, 60), wait_event FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
        ) + node_sql(
            9703,
            "SELECT left(query, 60), wait_event FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
        )
        node_sql(9701, "SELECT recover_prepared_transactions()")
        for t_ in threads:
            t_.join(timeout=30)
        other.dispose()
        print(
            f"took (s): { {k: round(v, 2) for k, v in took.items()} }; waiting after {BOUND:g} s: {blocked}; worker lock waits then: {waits}; errors {errs}"
        )
        for k in blocked:
            problems.append(
                f"{k} waited more than {BOUND:g} s, until recover_prepared_transactions()"
                f" ({took.get(k, 0):.1f} s in all); worker lock waits: {waits}"
            )
    verdict(problems, "a cut subscribe does not block later subscribes and publishes")


if __name__ == "__main__":
    main()
