"""A subscribe (`start="earliest"`) while a publish's two-phase commit is half done: the
publish returned its id (the coordinator committed) but its `message` row is still a
prepared transaction on the topic's worker, left there by a worker connection cut until
Citus's recovery (`citus.recover_2pc_interval`, 1 min here).

Topic `t` has no group (with `ATK_WITH_GROUP=1`: one group, `first`); its `message`
shard is on worker X (`ATK_TOPIC_PORT=9702`: on that worker, Citus's first, where a
reference table's writes take their shard lock). A publisher commits one
message per transaction on one coordinator session while a thread terminates that
session's backends on X once they sit idle after `PREPARE TRANSACTION`; it stops once a
publish is left prepared on X (>100 ms). Then `pgq.subscribe(engine, "late", "t")`
(earliest) and, at the same time, a subscribe to another topic `u` and a publish to `t`,
each timed (bounded at 20 s: then `recover_prepared_transactions()` is called to let them
through). After recovery the rows of `late` are compared with the messages of `t`.

Expected: `late` gets a row for every message of `t` (all were published, i.e. returned
their id, before the subscribe began: "with start="earliest" the group gets a delivery
row for every retained message"), and the subscribes and the publish answer promptly.
Observed: printed; exit 1 when `late` lacks a present message, or a subscribe / publish
waited until the prepared transactions were recovered.
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
    with CitusSchema("subpend") as s:
        want = int(os.environ.get("ATK_TOPIC_PORT", "0"))  # put t's shard on this worker
        n = 0
        while True:
            pgq.create_topic(s.engine, f"t{n}")
            if not want or s.topic_port(f"t{n}") == want:
                break
            n += 1
        T = f"t{n}"
        pgq.create_topic(s.engine, "u")
        if os.environ.get("ATK_WITH_GROUP") == "1":  # publishes then also write a group's rows
            pgq.subscribe(s.engine, "first", T)
        x = s.topic_port(T)
        pub = s.engine.connect()
        cpid = pub.execute(text("SELECT pg_backend_pid()")).scalar()
        pub.commit()
        app = f"citus_internal gpid={10_000_000_000 + int(cpid)}"
        prefix = f"citus_0_{cpid}_"
        stop = threading.Event()

        def killer() -> None:
            with psycopg.connect(node_dsn(x), autocommit=True) as w:
                while not stop.is_set():
                    w.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name = %s AND state = 'idle'"
                        " AND query LIKE 'PREPARE TRANSACTION%%'",
                        (app,),
                    )

        th = threading.Thread(target=killer, daemon=True)
        th.start()
        published: list[int] = []
        pending: list[tuple] = []
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline and not pending:
            try:
                with pub.begin():
                    published += pgq.publish_many(pub, T, [{"n": len(published)}])
            except Exception:
                try:
                    pub.rollback()
                except Exception:
                    pass
            pending = node_sql(
                x,
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s"
                " AND prepared < now() - interval '100 ms'",
                (prefix + "%",),
            )
        stop.set()
        th.join()
        pub.close()
        print(f"t on {x}: published {len(published)}; prepared, not committed on {x}: {pending}")
        if not pending:
            verdict([], "subscribe vs a half-done publish (window not reached this run)")
        visible = {
            r[0]
            for r in s.sql(f'SELECT id FROM "{s.name}".message WHERE topic_id = :t', t=s.tid(T))
        }
        print(f"messages of t published but not visible now: {sorted(set(published) - visible)}")
        took: dict[str, float] = {}
        errs: dict[str, str] = {}

        def timed(name, fn) -> None:
            t0 = time.monotonic()
            try:
                fn()
            except Exception as exc:
                errs[name] = f"{type(exc).__name__}: {exc}"
            took[name] = time.monotonic() - t0

        other = pgq.connect(DSN, schema=s.name)
        jobs = {
            "subscribe late->t": lambda: pgq.subscribe(s.engine, "late", T),
            "subscribe other->u": lambda: pgq.subscribe(other, "other", "u"),
            "publish t": lambda: pgq.publish(other, T, {"after": True}),
        }
        threads = [threading.Thread(target=timed, args=(n, f)) for n, f in jobs.items()]
        for t_ in threads:
            t_.start()
            time.sleep(0.2)
        until = time.monotonic() + BOUND
        for t_ in threads:
            t_.join(timeout=max(0.0, until - time.monotonic()))
        blocked = [n for n, t_ in zip(jobs, threads, strict=True) if t_.is_alive()]
        node_sql(9701, "SELECT recover_prepared_transactions()")
        for t_ in threads:
            t_.join(timeout=30)
        other.dispose()
        print(
            f"took (s): { {k: round(v, 2) for k, v in took.items()} }; still waiting after {BOUND:g} s: {blocked}; errors {errs}"
        )
        for n in blocked:
            problems.append(
                f"{n} waited more than {BOUND:g} s, until recover_prepared_transactions()"
                f" committed the cut publish ({took.get(n, 0):.1f} s in all)"
            )
        msgs = {
            r[0]
            for r in s.sql(f'SELECT id FROM "{s.name}".message WHERE topic_id = :t', t=s.tid(T))
        }
        rows = {
            r[0]
            for r in s.sql(
                f'SELECT message_id FROM "{s.name}".delivery WHERE group_id = :g', g=s.gid("late")
            )
        }
        missing = sorted(m for m in set(published) & msgs if m not in rows)
        print(
            f"late: {len(rows)} rows; messages of t {len(msgs)}; present messages it lacks: {missing}"
        )
        if missing:
            problems.append(
                f"group 'late' (earliest, subscribed after these publishes returned) has no row for"
                f" present message(s) {missing}: the subscribe's backfill ran while they were"
                f" prepared on {x}; they are never delivered to it"
            )
    verdict(problems, "a subscribe during a half-done publish on Citus")


if __name__ == "__main__":
    main()
