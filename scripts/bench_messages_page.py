"""How long one page of the dashboard's messages page takes on a 1,000,000-row group
(issue 23).

Builds a scratch schema with one topic and one group of `--rows` messages and
delivery rows (default 1,000,000), written with `INSERT ... SELECT
generate_series`: 90 % `ready`, 10 % `dead` (every tenth id, half of them with a
`message` error "ValueError: bad total", half `systemic` "ConnectionError:
billing down"), payload `{"n": n, "customer": {"id": "c<n mod 1000>"}}`, key
`k<n mod 97>`; VACUUM ANALYZE. Then it times, each `--repeat` times after a
warm-up, `pgq.store.messages.find` (50 rows) for: the first page; a page deep in
the group (from id 900,000 on); the last page, newest first; dead rows; dead
rows of one class; a payload field (`customer.id` = `c7`: 0.1 % of rows); an
error text; an id; and a payload value that no row has (the bounded window's
worst case); then `GET /groups/g/messages?...` through the real server for the
first and the deep page.

Usage:
    .venv/bin/python scripts/bench_messages_page.py [--dsn DSN] [--rows 1000000]
        [--repeat 20] [--keep]

The DSN defaults to `$PGQ_DSN`, else postgresql://postgres@127.0.0.1:5432/postgres;
the scratch schema `bench_msgs_<random>` is dropped at the end unless `--keep`.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, text  # noqa: E402

import pgq  # noqa: E402
from pgq.records import MessageFilter  # noqa: E402
from pgq.store.messages import find  # noqa: E402
from pgq.web import dashboard_server  # noqa: E402


def build(engine: Engine, schema: str, rows: int) -> None:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    s = f'"{schema}"'
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {s}.message (topic_id, key, payload, created_at)"
                f" SELECT tp.id, 'k' || (n % 97), jsonb_build_object('n', n, 'customer',"
                f" jsonb_build_object('id', 'c' || (n % 1000))),"
                f" now() - make_interval(secs => :n - n)"
                f" FROM {s}.topic tp, generate_series(1, :n) n ORDER BY n"
            ),
            {"n": rows},
        )
        conn.execute(
            text(
                f"""
INSERT INTO {s}.delivery (group_id, message_id, xid, state, attempts, error_class,
    last_error, error_epoch)
SELECT g.id, m.id, m.xid,
    CASE WHEN m.id % 10 = 0 THEN 'dead' ELSE 'ready' END,
    CASE WHEN m.id % 10 = 0 THEN 5 ELSE 0 END,
    CASE WHEN m.id % 20 = 0 THEN 'systemic' WHEN m.id % 10 = 0 THEN 'message' END,
    CASE WHEN m.id % 20 = 0 THEN 'ConnectionError: billing down'
         WHEN m.id % 10 = 0 THEN 'ValueError: bad total' END,
    CASE WHEN m.id % 10 = 0 THEN 0 END
FROM {s}.message m, {s}.consumer_group g ORDER BY m.id
"""
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {s}.message"))
        conn.execute(text(f"VACUUM ANALYZE {s}.delivery"))


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[max(0, round(0.95 * len(times)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("PGQ_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    schema = f"bench_msgs_{secrets.token_hex(3)}"
    engine = pgq.connect(args.dsn, schema=schema)
    try:
        pgq.migrate(engine)
        t0 = time.perf_counter()
        build(engine, schema, args.rows)
        sys.stdout.write(f"built {args.rows:,} rows in {time.perf_counter() - t0:.1f} s\n")
        deep = int(args.rows * 0.9)
        cases: dict[str, Callable[[], object]] = {
            "first page": lambda: find(engine, "g"),
            f"from id {deep:,}": lambda: find(engine, "g", after=deep),
            "last page, newest first": lambda: find(engine, "g", descending=True),
            "dead, from the middle": lambda: find(
                engine, "g", MessageFilter(state="dead"), after=args.rows // 2
            ),
            "dead of class systemic": lambda: find(
                engine, "g", MessageFilter(state="dead", error_class="systemic")
            ),
            "payload customer.id = c7 (0.1 %)": lambda: find(
                engine, "g", MessageFilter(field="customer.id", value="c7")
            ),
            "error text 'billing down'": lambda: find(
                engine, "g", MessageFilter(error="billing down")
            ),
            "id": lambda: find(engine, "g", MessageFilter(message_id=deep + 1)),
            "payload value no row has (window)": lambda: find(
                engine, "g", MessageFilter(field="customer.id", value="none")
            ),
        }
        sys.stdout.write(f"| {args.rows:,} rows: `find`, 50 rows | median ms | p95 ms |\n")
        sys.stdout.write("|---|---:|---:|\n")
        for name, fn in cases.items():
            med, p95 = timed(fn, args.repeat)
            sys.stdout.write(f"| {name} | {med:.1f} | {p95:.1f} |\n")
        server = dashboard_server(engine, port=0)
        server.start()
        try:
            parts = urllib.parse.urlsplit(server.url)

            def get(path: str) -> None:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
                conn.request("GET", path)
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 200, resp.status
                conn.close()

            for path in ("/groups/g/messages", f"/groups/g/messages?next={deep}"):
                med, p95 = timed(lambda p=path: get(p), args.repeat)
                sys.stdout.write(f"| `GET {path}` (real server) | {med:.1f} | {p95:.1f} |\n")
        finally:
            server.close()
    finally:
        if not args.keep:
            with engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


if __name__ == "__main__":
    main()
