"""What a chart sample costs on a big group (decision 0045), against `pgq status`'s counts.

A scratch schema gets one group with `--rows` ready rows (and a thousandth of them
dead), written straight into `delivery` as publishing would, then vacuumed and
analyzed; each statement then runs `--runs` times on one connection, and the median
is printed:

- `due_sample`, when the minute has no sample: the numbers a sample holds;
- `due_sample`, when it has one: what every writer but the first pays;
- `write_sample`: the insert;
- `group_lag`: what each member's progress line reads twice a minute already;
- `group_counts`: what `pgq status GROUP` reads for its counts (every row of the group).

    .venv/bin/python scripts/sample_cost.py --dsn postgresql://postgres@127.0.0.1/postgres

The scratch schema `pgq_sample_cost` is dropped at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from sqlalchemy import Connection, text

import pgq
from pgq.sql import samples as q
from pgq.sql import status
from pgq.store.topics import group_info

SCHEMA = "pgq_sample_cost"


def timed(conn: Connection, run: Callable[[], object], runs: int) -> float:
    """Median milliseconds of `run()`, each in a transaction rolled back."""
    found = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        found.append((time.perf_counter() - start) * 1000)
        conn.rollback()
    return statistics.median(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    engine = pgq.connect(args.dsn, schema=SCHEMA)
    try:
        pgq.migrate(engine)
        pgq.create_topic(engine, "t")
        pgq.subscribe(engine, "g", "t")
        gid = group_info(engine, "g").id
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.message (topic_id, payload)"
                    f" SELECT (SELECT id FROM {SCHEMA}.topic), '{{}}' FROM generate_series(1, :n)"
                ),
                {"n": args.rows},
            )
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.delivery (group_id, message_id) SELECT :g, id"
                    f" FROM {SCHEMA}.message"
                ),
                {"g": gid},
            )
            conn.execute(
                text(
                    f"UPDATE {SCHEMA}.delivery SET state = 'dead', error_class = 'message'"
                    " WHERE message_id % 1000 = 0"
                )
            )
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                text(f"VACUUM ANALYZE {SCHEMA}.delivery")
            )
        with engine.connect() as conn:
            params = {"gid": gid}
            due = timed(conn, lambda: conn.execute(q.due_sample(), params).one(), args.runs)
            row = conn.execute(q.due_sample(), params).mappings().one()
            conn.rollback()
            wrote = timed(
                conn, lambda: conn.execute(q.write_sample(), {**params, **row}).one(), args.runs
            )
            conn.execute(q.write_sample(), {**params, **row})
            conn.commit()
            taken = timed(conn, lambda: conn.execute(q.due_sample(), params).all(), args.runs)
            lag = timed(
                conn, lambda: conn.execute(status.group_lag(), {"gid": gid}).one(), args.runs
            )
            counts = timed(
                conn,
                lambda: conn.execute(status.group_counts(), {"group_id": gid}).one(),
                args.runs,
            )
        print(f"rows={args.rows} lag={row['lag']} dead={row['dead']} runs={args.runs} (median ms)")
        print(f"due_sample, minute not sampled: {due:.2f}")
        print(f"due_sample, minute sampled:     {taken:.3f}")
        print(f"write_sample:                   {wrote:.3f}")
        print(f"group_lag (the progress line):  {lag:.2f}")
        print(f"group_counts (pgq status):      {counts:.2f}")
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        engine.dispose()


if __name__ == "__main__":
    main()
