"""`pgq purge` deletes the dead rows a breaker that opened during the purge will refund.

What it shows: `purge` (pgq/store/admin.py) reads the breaker row and deletes dead
rows in one REPEATABLE READ snapshot. Rows a reconciliation changes meanwhile make
it fail, but the breaker *opening* changes only the breaker row, which the purge
read without a lock: a purge whose snapshot saw CLOSED (nothing pending) deletes
the dead systemic rows of the epoch that is being tripped, though the OPEN group
now owes them a refund (`pgq check` calls them pending; decision 0017 says they
are kept). The messages are lost: the close will never run them again.

Made deterministic here: another session holds a plain row lock (no change) on the
dead rows, so the purge's DELETE waits after its snapshot; meanwhile the breaker
opens (the exact UPDATE + history row `pgq.sql.breaker.open_on_quorum` makes, done
by hand since quorum needs two live members); then the lock is released. In
production the window is the few milliseconds between the purge's first read and
its DELETE, or as long as any row lock (a requeue, a reconciliation batch) lasts.

Expected: the purge keeps the rows (or fails with nothing written); `kept 3`.
Fix: serialise the purge with breaker transitions, e.g. a transaction-level
advisory lock (shared in purge, before its snapshot; exclusive in open_on_quorum's
transaction), or recheck the breaker after the DELETE in a READ COMMITTED read
and roll back when it moved.

Run: .venv/bin/python scripts/attacks/purge_races_breaker_open.py (~15 s). Exit 1
while the defect exists, 0 once fixed. Severity: messages lost.
"""

import subprocess
import threading
import time

import psycopg
from _common import DSN, PGQ, Schema, states, verdict

import pgq
from pgq.sql.locks import breaker_flip_key

problems = []


def fail(msg):
    raise pgq.SystemicError("upstream down")


def open_breaker(sch, gid):
    """What open_on_quorum writes, after the breaker-flip lock it takes first."""
    with psycopg.connect(DSN, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (breaker_flip_key(sch, "g"),))
        epoch = conn.execute(
            f'UPDATE "{sch}".breaker SET state = %s, epoch = epoch + 1, since = now(),'
            " next_probe_at = now(), probe_failures = 0, prober = NULL"
            " WHERE group_id = %s AND state = %s RETURNING epoch",
            ("OPEN", gid, "CLOSED"),
        ).fetchone()[0]
        conn.execute(
            f'INSERT INTO "{sch}".breaker_history (group_id, epoch, state, by_member)'
            " VALUES (%s, %s, %s, %s)",
            (gid, epoch, "OPEN", "attacker"),
        )
    with psycopg.connect(DSN, autocommit=True) as conn:  # had the purge committed by then?
        purges = f'SELECT count(*) FROM "{sch}".audit WHERE group_id = %s AND action = %s'
        purged_before_open.append(conn.execute(purges, (gid, "purge")).fetchone()[0] > 0)


purged_before_open = []


with Schema("purgerace") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish_many(s.engine, "t", [{"n": i} for i in range(3)])
    # one member: three systemic deaths, below min_calls, no quorum: the group stays CLOSED
    c = pgq.Consumer(s.engine, "g", fail, workers=1, max_attempts=1, breaker_min_members=2)
    c.run(until_empty=True)
    before = states(s, "g")
    sch = s.name
    with psycopg.connect(DSN, autocommit=False) as locker:
        gid = locker.execute(f'SELECT id FROM "{sch}".consumer_group WHERE name = %s', ("g",))
        gid = gid.fetchone()[0]
        dead = locker.execute(
            f'SELECT message_id FROM "{sch}".delivery WHERE group_id = %s AND state = %s'
            " FOR UPDATE",
            (gid, "dead"),
        ).fetchall()
        purge = subprocess.Popen(
            [PGQ, "purge", "g", "--dead", "--reason", "cleanup"],
            env=s.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        waiting = False
        deadline = time.monotonic() + 30
        with psycopg.connect(DSN, autocommit=True) as watch:
            while time.monotonic() < deadline and not waiting:
                waiting = bool(
                    watch.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query ILIKE %s",
                        (f"%DELETE FROM%{sch}%delivery%",),
                    ).fetchone()
                )
                time.sleep(0.05)
            if not waiting:
                problems.append("setup: the purge never waited on the row lock")
            # the breaker opens as open_on_quorum does (its lock first, then the flip),
            # in a thread: with the fix it waits until the purge has committed
            opening = threading.Thread(target=open_breaker, args=(sch, gid))
            opening.start()
            time.sleep(1.0)  # without the fix the open commits now, mid-purge
        locker.rollback()  # nothing changed: the purge's DELETE goes on
        out, err = purge.communicate(timeout=60)
        opening.join(60)
    check = s.pgq("check", "g")
    after = states(s, "g")
    # deleting is right only if the purge committed before the breaker opened
    if after.get("dead", 0) < before.get("dead", 0) and purged_before_open != [True]:
        problems.append(
            f"dead rows {before.get('dead', 0)} -> {after.get('dead', 0)} while OPEN"
            f" (purge said {out.strip() or err.strip()!r}; check now says"
            f" {check.stdout.strip()!r}): rows the reconciliation owes are gone"
        )
verdict(problems, "a purge never deletes rows the breaker that just opened will refund")
