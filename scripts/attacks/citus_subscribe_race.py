"""Concurrent publishers on several topics racing subscribes and retention on Citus; with
`ATK_CUT=1` a thread also terminates this script's own coordinator sessions' backends on
the workers (`pg_terminate_backend` on `citus_internal gpid=<gpid>`, now and then, when
one sits idle after `PREPARE TRANSACTION`), then Citus's
`recover_prepared_transactions()` runs before the check.

3 topics; per topic a publisher thread (one message per transaction, records the time
before it began and the id once committed); a subscriber thread subscribing new groups
(`latest` and `earliest` alternately) to random topics, recording when each subscribe
returned; a retention thread running `GroupStore.expire_messages` (retention 0) on every
topic. No consumer runs: every delivery row stays ready and holds its message, and what
retention deletes is what was published while the topic had no group yet.

Expected: (1) every group has a row for every message of its topic whose publish began
after the group's subscribe returned, and an `earliest` group for every message committed
before it; (2) no delivery row without its message; (3) no message deleted while a group
that should have it lacks its row.
Observed: printed; exit 1 on any miss or orphan.
"""

from __future__ import annotations

import os
import random
import threading
import time

import psycopg
from citus_common import CitusSchema, node_dsn, node_sql, verdict
from sqlalchemy import text

import pgq
from pgq.store.group import GroupStore

SECONDS = float(os.environ.get("ATK_SECONDS", "30"))
CUT = os.environ.get("ATK_CUT") == "1"
TOPICS = ["t0", "t1", "t2"]


def main() -> None:
    problems: list[str] = []
    rnd = random.Random(int(os.environ.get("ATK_SEED", "1")))
    with CitusSchema("subrace") as s:
        for tp in TOPICS:
            pgq.create_topic(s.engine, tp)
        tids = {tp: s.tid(tp) for tp in TOPICS}
        stop = threading.Event()
        pubs: list[tuple[str, int, float, float]] = []  # topic, id, began, committed
        subs: list[tuple[str, str, str, float, float]] = []  # group, topic, start, began, returned
        errors: dict[str, int] = {}
        gpids: set[str] = set()
        lock = threading.Lock()

        def err(kind: str, exc: BaseException) -> None:
            with lock:
                key = f"{kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                errors[key] = errors.get(key, 0) + 1

        def session():
            conn = s.engine.connect()
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
            conn.commit()
            with lock:
                gpids.add(f"citus_internal gpid={10_000_000_000 + int(pid)}")
            return conn

        def publisher(tp: str) -> None:
            conn = session()
            while not stop.is_set():
                began = time.time()
                try:
                    with conn.begin():
                        ids = pgq.publish_many(conn, tp, [{"at": began}])
                    with lock:
                        pubs.append((tp, ids[0], began, time.time()))
                except Exception as exc:
                    err("publish", exc)
                    try:
                        conn.rollback()
                    except Exception:
                        conn = session()

        def subscriber() -> None:
            conn = session()
            n = 0
            while not stop.is_set():
                tp = rnd.choice(TOPICS)
                start = "latest" if n % 2 else "earliest"
                name = f"s{n}"
                began = time.time()
                try:
                    with conn.begin():
                        pgq.subscribe(conn, name, tp, start=start)
                    with lock:
                        subs.append((name, tp, start, began, time.time()))
                except Exception as exc:
                    err("subscribe", exc)
                    try:
                        conn.rollback()
                    except Exception:
                        conn = session()
                n += 1
                time.sleep(0.05)

        def retention() -> None:
            conn = session()
            stores = {
                tp: GroupStore(0, "", tp, "atk-ret", 1.0, 1, topic_id=tids[tp]) for tp in TOPICS
            }
            while not stop.is_set():
                for tp in TOPICS:
                    try:
                        with conn.begin():
                            stores[tp].expire_messages(conn, tids[tp], 0.0, 500)
                    except Exception as exc:
                        err("retention", exc)
                        try:
                            conn.rollback()
                        except Exception:
                            conn = session()
                time.sleep(0.02)

        def cutter() -> None:
            ws = [psycopg.connect(node_dsn(p), autocommit=True) for p in s.workers()]
            while not stop.is_set():
                w = rnd.choice(ws)
                with lock:
                    apps = list(gpids)
                w.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = ANY(%s) AND state = 'idle'"
                    " AND query LIKE 'PREPARE TRANSACTION%%' AND random() < 0.3",
                    (apps,),
                )
            for w in ws:
                w.close()

        threads = [threading.Thread(target=publisher, args=(tp,)) for tp in TOPICS]
        threads += [threading.Thread(target=subscriber), threading.Thread(target=retention)]
        if CUT:
            threads.append(threading.Thread(target=cutter))
        for th in threads:
            th.start()
        time.sleep(SECONDS)
        stop.set()
        for th in threads:
            th.join(timeout=60)
        node_sql(9701, "SELECT recover_prepared_transactions()")
        for tp in TOPICS:  # one more retention pass after recovery
            with s.engine.begin() as conn:
                GroupStore(0, "", tp, "atk-ret", 1.0, 1, topic_id=tids[tp]).expire_messages(
                    conn, tids[tp], 0.0, 10_000
                )
        print(f"published {len(pubs)}, subscribed {len(subs)}; errors: {errors}")
        slow = sorted(((r - b, n) for n, _t, _s, b, r in subs), reverse=True)[:3]
        print(f"slowest subscribes (s): {[(round(d, 2), n) for d, n in slow]}")
        msgs = {r[0]: r[1] for r in s.sql(f'SELECT id, topic_id FROM "{s.name}".message')}
        rows: dict[str, set[int]] = {}
        gname = {r[0]: r[1] for r in s.sql(f'SELECT id, name FROM "{s.name}".consumer_group')}
        for gid_, mid in s.sql(f'SELECT group_id, message_id FROM "{s.name}".delivery'):
            rows.setdefault(gname[gid_], set()).add(mid)
        orphans = [(g, m) for g, ms in rows.items() for m in ms if m not in msgs]
        if orphans:
            problems.append(f"{len(orphans)} delivery rows without their message: {orphans[:10]}")
        missed: list[str] = []
        for name, tp, start, began, returned in subs:
            have = rows.get(name, set())
            for ptp, mid, pbegan, pcommitted in pubs:
                if ptp != tp:
                    continue
                after = pbegan > returned
                before = start == "earliest" and pcommitted < began and mid in msgs
                if (after or before) and mid not in have:
                    missed.append(
                        f"{name} ({start}, subscribed {began:.3f}-{returned:.3f}) lacks message"
                        f" {mid} (publish {pbegan:.3f}-{pcommitted:.3f}, message"
                        f" {'present' if mid in msgs else 'deleted'})"
                    )
        if missed:
            problems.append(f"{len(missed)} rows missing: " + "; ".join(missed[:8]))
        print(f"orphans {len(orphans)}, missing {len(missed)}")
    verdict(
        problems, "publish/subscribe/retention race on Citus" + (" with worker cuts" if CUT else "")
    )


if __name__ == "__main__":
    main()
