"""Ordered against unordered groups: how fast one member drains a backlog whose
messages carry `--keys` distinct keys (issue 22, part 2).

For each key count (default 10, 1,000 and 100,000) it builds a scratch schema with
one topic, an ordered group `o` and an unordered group `u`, and `--n` messages
(default 20,000) with key `k<i mod keys>`, interleaved (`INSERT ... SELECT
generate_series`, then one delivery row per group as `publish` writes it: the key on
the ordered group's row only); VACUUM ANALYZE. Then one member with the default
settings and a handler that does nothing drains each group (`run(until_empty=True)`),
unordered and ordered alternating, `--reps` times. It prints messages per second
for each and the ratio ordered / unordered, per key count.

With 10 keys at most 10 messages can run at once, whatever the workers: the ratio
there measures the ceiling the order sets, not the claim's cost.

Usage:
    .venv/bin/python scripts/bench_ordered.py [--dsn DSN] [--n 20000]
        [--keys 10,1000,100000] [--reps 3]

The DSN defaults to `$PGQ_DSN`, else postgresql://postgres@127.0.0.1:5432/postgres;
each scratch schema `bench_ordered_<random>` is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, text  # noqa: E402

import pgq  # noqa: E402


def build(engine: Engine, schema: str, n: int, keys: int) -> None:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "o", "t", ordered=True)
    pgq.subscribe(engine, "u", "t")
    s = f'"{schema}"'
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {s}.message (topic_id, key, payload)"
                f" SELECT tp.id, 'k' || (i % :keys), jsonb_build_object('i', i)"
                f" FROM {s}.topic tp, generate_series(1, :n) i ORDER BY i"
            ),
            {"n": n, "keys": keys},
        )
        conn.execute(
            text(
                f"INSERT INTO {s}.delivery (group_id, message_id, key)"
                f" SELECT g.id, m.id, CASE WHEN g.ordered THEN m.key END"
                f" FROM {s}.message m CROSS JOIN {s}.consumer_group g ORDER BY m.id, g.id"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM ANALYZE {s}.message, {s}.delivery"))


def drain(engine: Engine, group: str) -> tuple[float, int]:
    """Seconds one default member takes to drain `group`, and the messages it handled."""
    started = time.perf_counter()
    summary = pgq.Consumer(engine, group, lambda msg: None).run(until_empty=True)
    return time.perf_counter() - started, summary.done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dsn = os.environ.get("PGQ_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--dsn", default=default_dsn)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--keys", default="10,1000,100000")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"{'keys':>8} {'unordered msg/s':>16} {'ordered msg/s':>14} {'ratio':>6}")
    for keys in (int(k) for k in args.keys.split(",")):
        rates: dict[str, list[float]] = {"u": [], "o": []}
        for _ in range(args.reps):
            schema = f"bench_ordered_{secrets.token_hex(4)}"
            engine = pgq.connect(args.dsn, schema=schema)
            try:
                pgq.migrate(engine)
                build(engine, schema, args.n, keys)
                for group in ("u", "o"):
                    seconds, done = drain(engine, group)
                    if done != args.n:
                        print(f"group {group} handled {done} of {args.n}", file=sys.stderr)
                        return 1
                    rates[group].append(done / seconds)
            finally:
                with engine.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
                engine.dispose()
        u, o = statistics.median(rates["u"]), statistics.median(rates["o"])
        print(f"{keys:>8} {u:>16,.0f} {o:>14,.0f} {o / u:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
