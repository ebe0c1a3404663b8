"""How long the dashboard's overview takes on a big installation (issue 13).

Builds a scratch schema with `--groups` groups (default 50) over `--topics`
topics and `--rows` delivery rows in all (default 1,000,000), written with
`INSERT ... SELECT generate_series` in seconds, in the states a busy
installation has: mostly `done` (behind a frontier that pruning has not
reached yet), some `ready` (part of them waiting for a retry), a few `leased`
by live-looking members, and `dead` of every class (systemic ones too);
three members per group, a few groups OPEN with a breaker history. Then it
measures, each `--repeat` times after a warm-up:

- `Dashboard.overview()` alone (what the page shows, read through `pgq.monitor`);
- `GET /` through the real server (waitress + Flask + the template);
- and, for the breakdown, `monitor.status_all` and the per-group `dead_split`,
  plus every SQL statement of one overview with its time (`--explain` adds
  `EXPLAIN (ANALYZE, BUFFERS)` of the slowest ones).

Usage:
    .venv/bin/python scripts/bench_web.py [--dsn DSN] [--groups 50] [--rows 1000000]
        [--repeat 20] [--explain] [--keep]

The DSN defaults to `$PGQ_DSN`, else postgresql://postgres@127.0.0.1:5432/postgres;
the scratch schema `bench_web_<random>` is dropped at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import http.client
import os
import secrets
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, event, text  # noqa: E402

import pgq  # noqa: E402
from pgq import monitor  # noqa: E402
from pgq.web import Dashboard, WebOptions, dashboard_server  # noqa: E402

TARGET_MS = 300.0


def build(engine: Engine, schema: str, groups: int, topics: int, rows: int) -> dict[str, Any]:
    """The scratch installation; returns what was built (counts by state)."""
    per_group = rows // groups
    for i in range(topics):
        pgq.create_topic(engine, f"topic{i:02d}")
    for g in range(groups):
        pgq.subscribe(engine, f"group{g:02d}", f"topic{g % topics:02d}")
    s = f'"{schema}"'
    t0 = time.perf_counter()
    with engine.begin() as conn:
        # every topic gets `per_group` messages: each of its groups has one row per message
        conn.execute(
            text(
                f"INSERT INTO {s}.message (topic_id, key, payload, headers, created_at)"
                f" SELECT tp.id, 'k' || (n % 97), jsonb_build_object('n', n, 'body',"
                f" repeat('x', 40)), NULL, now() - make_interval(secs => {per_group} - n)"
                f" FROM {s}.topic tp, generate_series(1, :n) n ORDER BY n, tp.id"
            ),
            {"n": per_group},
        )
        # states by message position: 94 % done, 3 % ready (a third waiting for a retry),
        # 0.5 % leased, 2.5 % dead (systemic, message, permanent, lease in turn)
        conn.execute(
            text(
                f"""
INSERT INTO {s}.delivery (group_id, message_id, xid, state, available_at, attempts,
    reclaims, refundable_attempts, lease_owner, lease_seq, lease_expires_at,
    error_class, last_error, error_epoch, updated_at)
SELECT g.id, m.id, m.xid, x.state,
    CASE WHEN x.state = 'ready' AND x.r % 3 = 0 THEN now() + interval '5 minutes'
         ELSE m.created_at END,
    CASE x.state WHEN 'done' THEN 1 WHEN 'dead' THEN 5 WHEN 'ready' THEN x.r % 3
         ELSE 0 END,
    CASE WHEN x.state = 'dead' AND x.r % 4 = 3 THEN 3 ELSE 0 END,
    CASE WHEN x.state = 'dead' AND x.r % 4 = 0 THEN 5 ELSE 0 END,
    CASE WHEN x.state = 'leased' THEN 'bench-host-' || (x.r % 3) END,
    CASE WHEN x.state = 'leased' THEN m.id ELSE 0 END,
    CASE WHEN x.state = 'leased' THEN now() + interval '30 seconds' END,
    CASE WHEN x.state = 'dead' THEN (ARRAY['systemic','message','permanent','lease'])[x.r % 4 + 1]
         WHEN x.state = 'ready' AND x.r % 3 = 0 THEN 'message' END,
    CASE WHEN x.state = 'dead' THEN 'ValueError: bench failure ' || x.r
         WHEN x.state = 'ready' AND x.r % 3 = 0 THEN 'ValueError: retry' END,
    CASE WHEN x.state = 'dead' OR (x.state = 'ready' AND x.r % 3 = 0) THEN 0 END,
    m.created_at
FROM {s}.consumer_group g
JOIN {s}.message m ON m.topic_id = g.topic_id
CROSS JOIN LATERAL (
    SELECT (m.id * 7919 + g.id) % 1000 AS r
) p
CROSS JOIN LATERAL (
    SELECT p.r AS r, CASE WHEN p.r < 940 THEN 'done' WHEN p.r < 970 THEN 'ready'
                          WHEN p.r < 975 THEN 'leased' ELSE 'dead' END AS state
) x
"""
            )
        )
        # frontier at the last done row before the first unresolved one; pruned counts
        conn.execute(
            text(
                f"UPDATE {s}.group_state g SET committed_id = f.id, done_pruned = 200000,"
                f" reclaimed_total = 1234, released_total = 567, refunded_total = 89"
                f" FROM (SELECT group_id, min(message_id) - 1 AS id FROM {s}.delivery"
                f" WHERE state IN ('ready', 'leased') GROUP BY group_id) f"
                f" WHERE f.group_id = g.group_id"
            )
        )
        conn.execute(
            text(
                f"INSERT INTO {s}.member (group_id, name, host, pid, local_breaker)"
                f" SELECT g.id, 'bench-host-' || k, 'host' || k, 1000 + k,"
                f" CASE WHEN k = 0 AND g.id % 10 = 0 THEN 'open' ELSE 'closed' END"
                f" FROM {s}.consumer_group g, generate_series(0, 2) k"
            )
        )
        # every tenth group OPEN (an outage in progress), with its history
        conn.execute(
            text(
                f"UPDATE {s}.breaker SET state = 'OPEN', epoch = 3, since = now() - interval"
                f" '2 minutes', next_probe_at = now() + interval '5 seconds'"
                f" WHERE group_id % 10 = 0"
            )
        )
        conn.execute(
            text(
                f"INSERT INTO {s}.breaker_history (group_id, epoch, state, at, refunded,"
                f" by_member) SELECT g.id, e, CASE WHEN e % 2 = 1 THEN 'OPEN' ELSE 'CLOSED' END,"
                f" now() - make_interval(mins => 60 - e * 10), e * 10, 'bench-host-0'"
                f" FROM {s}.consumer_group g, generate_series(1, 3) e WHERE g.id % 10 = 0"
            )
        )
    built = time.perf_counter() - t0
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        t1 = time.perf_counter()
        for table in ("message", "delivery", "member", "consumer_group", "breaker"):
            conn.execute(text(f"VACUUM (ANALYZE) {s}.{table}"))
        vacuumed = time.perf_counter() - t1
        counts = dict(
            conn.execute(text(f"SELECT state, count(*) FROM {s}.delivery GROUP BY 1")).all()
        )
        size = conn.execute(
            text(f"SELECT pg_size_pretty(pg_total_relation_size('{s}.delivery'))")
        ).scalar_one()
    return {"insert_s": built, "vacuum_s": vacuumed, "counts": counts, "delivery_size": size}


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()  # warm-up: caches, prepared statements, the pool
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def summary(ms: list[float]) -> str:
    ordered = sorted(ms)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (
        f"median {statistics.median(ms):7.1f} ms  p95 {p95:7.1f} ms"
        f"  min {ordered[0]:7.1f}  max {ordered[-1]:7.1f}  (n={len(ms)})"
    )


def get(url: str, path: str) -> int:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def statements(engine: Engine, fn: Callable[[], object]) -> list[tuple[float, str, Any]]:
    """Every statement `fn` runs, with its time in ms (wall, client side), slowest first."""
    seen: list[tuple[float, str, Any]] = []
    started: dict[int, float] = {}

    def before(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        started[id(cursor)] = time.perf_counter()

    def after(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        ms = (time.perf_counter() - started.pop(id(cursor), time.perf_counter())) * 1000
        seen.append((ms, statement, params))

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    try:
        fn()
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    return sorted(seen, key=lambda s: -s[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("PGQ_DSN") or None)
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--topics", type=int, default=10)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--explain", action="store_true", help="EXPLAIN ANALYZE the slow statements")
    ap.add_argument("--keep", action="store_true", help="keep the scratch schema")
    args = ap.parse_args()
    dsn = args.dsn or "postgresql://postgres@127.0.0.1:5432/postgres"
    schema = f"bench_web_{secrets.token_hex(3)}"
    print("command:", "python scripts/bench_web.py", " ".join(sys.argv[1:]))
    engine = pgq.connect(dsn, schema=schema)
    try:
        pgq.migrate(engine)
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
        info = build(engine, schema, args.groups, args.topics, args.rows)
        total = sum(info["counts"].values())
        print(
            f"built schema {schema}: {args.groups} groups, {total:,} delivery rows"
            f" {dict(sorted(info['counts'].items()))}, delivery {info['delivery_size']};"
            f" insert {info['insert_s']:.1f} s, vacuum analyze {info['vacuum_s']:.1f} s;"
            f" PostgreSQL {version}"
        )
        dash = Dashboard(engine, WebOptions())
        results = {
            "Dashboard.overview()": timed(dash.overview, args.repeat),
            "  monitor.status_all()": timed(lambda: monitor.status_all(engine), args.repeat),
            "  dead_split() of every group": timed(
                lambda: [monitor.dead_split(engine, f"group{g:02d}") for g in range(args.groups)],
                args.repeat,
            ),
        }
        server = dashboard_server(engine, host="127.0.0.1", port=0)
        server.start()
        try:
            assert get(server.url, "/") == 200
            results["GET / (real server)"] = timed(lambda: get(server.url, "/"), args.repeat)
            results["GET /?live=1 (real server)"] = timed(
                lambda: get(server.url, "/?live=1"), args.repeat
            )
        finally:
            server.close()
        print(f"\ntarget: the overview under {TARGET_MS:.0f} ms")
        for name, ms in results.items():
            print(f"{name:34} {summary(ms)}")
        slow = statements(dash._reads.engine, dash.overview)  # its reads run on its own engine
        print(f"\none overview: {len(slow)} statements, {sum(s[0] for s in slow):.1f} ms in all;")
        print("slowest:")
        for ms, stmt, _ in slow[:5]:
            print(f"  {ms:7.1f} ms  {' '.join(stmt.split())[:150]}")
        if args.explain:
            seen = set()
            for _, stmt, params in slow[:3]:
                if stmt in seen:
                    continue
                seen.add(stmt)
                with engine.connect() as conn:
                    plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + stmt, params).all()
                print("\nEXPLAIN (ANALYZE, BUFFERS)", " ".join(stmt.split())[:200])
                for (line,) in plan:
                    print("   ", line)
    finally:
        if args.keep:
            print(f"kept schema {schema}")
        else:
            with engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


if __name__ == "__main__":
    main()
