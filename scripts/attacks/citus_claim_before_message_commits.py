"""A delivery row visible on the group's worker before its message is visible on the
topic's worker (the publish's two-phase commit finished on one worker, not yet on the
other): the member leases the row, finds no message, skips it and leaves it leased; the
lease runs out, the row is reclaimed, and after `max_reclaims` such rounds it dies
(`lease`), although the message exists and was never handled.

Topic `t` with its `message` shard on worker X; group `g` on worker Y ≠ X (ids burnt on a
dummy topic until one lands there). A publisher commits one message per transaction on
one coordinator session while a thread terminates that session's backends on X
(`pg_terminate_backend` on `citus_internal gpid=<its gpid>`). Once a publish left its
message prepared-but-not-committed on X (the coordinator committed, the publish returned
its id), publishing and cutting stop, and `pgq consume g --until-empty` runs (lease 1 s,
max_reclaims 2); Citus's own recovery (`citus.recover_2pc_interval`, 1 min here) is left
to run as it would. Afterwards `recover_prepared_transactions()` and one more drain.

Expected: the member does not charge a reclaim for a message it could not read (it waits
or releases the row as it was), so every published message is handled once and none
dies; `--until-empty` ends.
Observed: printed; exit 1 when a published message ends dead, with reclaims charged, or
is never handled.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from citus_common import CitusSchema, node_dsn, node_sql, verdict
from sqlalchemy import text

import pgq

SECONDS = float(os.environ.get("ATK_SECONDS", "40"))


def place(s: CitusSchema) -> tuple[int, int]:
    pgq.create_topic(s.engine, "t")
    pgq.create_topic(s.engine, "burn")
    x = s.topic_port("t")
    n = 0
    while True:
        nxt = s.sql(f'SELECT coalesce(max(id), 0) + 1 FROM "{s.name}".consumer_group')[0][0]
        if s.port_of("delivery", nxt) != x:
            break
        pgq.subscribe(s.engine, f"burn{n}", "burn")
        n += 1
    pgq.subscribe(s.engine, "g", "t")
    y = s.group_port("g")
    assert y != x, (x, y)
    return x, y


def main() -> None:
    problems: list[str] = []
    with CitusSchema("claim2pc") as s, tempfile.TemporaryDirectory() as tmpd:
        x, y = place(s)
        print(f"topic t on {x}, group g on {y}")
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
                    pass

        th = threading.Thread(target=killer, daemon=True)
        th.start()
        published: list[int] = []
        pending: list[tuple] = []
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline and not pending:
            try:
                with pub.begin():
                    published += pgq.publish_many(pub, "t", [{"n": len(published)}])
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
        print(f"published {len(published)}; prepared and not committed on {x}: {pending}")
        if not pending:
            verdict([], "claim before the message commits (window not reached this run)")
        visible = {
            r[0]
            for r in s.sql(f'SELECT id FROM "{s.name}".message WHERE topic_id = :t', t=s.tid("t"))
        }
        rows = {
            r[0]
            for r in s.sql(
                f'SELECT message_id FROM "{s.name}".delivery WHERE group_id = :g', g=s.gid("g")
            )
        }
        print(f"rows of g without a visible message now: {sorted(rows - visible)}")
        t0 = time.monotonic()
        r = s.pgq(
            "consume", "g", "--handler", "citus_handlers:record", "--until-empty",
            timeout=50, ATK_DIR=tmpd, ATK_TAG="g", PGQ_LEASE=1, PGQ_MAX_RECLAIMS=2,
            PGQ_POLL_INTERVAL=0.2,
        )  # fmt: skip
        print(f"consume --until-empty: rc={r.returncode} after {time.monotonic() - t0:.1f}s")
        print(
            "\n".join(ln for ln in r.stderr.splitlines() if "not found" in ln or "dead" in ln)[
                :1500
            ]
        )
        node_sql(9701, "SELECT recover_prepared_transactions()")
        r2 = s.pgq(
            "consume", "g", "--handler", "citus_handlers:record", "--until-empty",
            timeout=50, ATK_DIR=tmpd, ATK_TAG="g", PGQ_LEASE=1, PGQ_MAX_RECLAIMS=2,
        )  # fmt: skip
        print(f"after recovery, consume --until-empty: rc={r2.returncode}")
        dead = s.sql(
            f'SELECT message_id, state, reclaims, error_class, last_error FROM "{s.name}".delivery'
            " WHERE group_id = :g AND state <> 'done'",
            g=s.gid("g"),
        )
        f = Path(tmpd, "ok-g")
        handled = {int(ln.split()[0]) for ln in f.read_text().splitlines()} if f.exists() else set()
        lost = sorted(set(published) - handled)
        print(f"published {len(published)}, handled {len(handled)}; not done: {dead}")
        if dead:
            problems.append(f"rows not done after the message became visible: {dead}")
        if lost:
            problems.append(f"published and never handled: {lost}")
        if r.returncode is None:
            problems.append("consume --until-empty did not end within 50 s")
    verdict(problems, "a row claimed before its message is visible is not charged or lost")


if __name__ == "__main__":
    main()
