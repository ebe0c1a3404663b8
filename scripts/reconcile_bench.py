"""Reconciliation rate: refund N dead systemic rows after a close, and how long
claims wait meanwhile.

    python scripts/reconcile_bench.py --dsn postgresql://postgres@127.0.0.1/postgres --n 100000

Creates a scratch schema, publishes N messages, marks them dead-systemic under
an OPEN breaker (as an outage would have left them), closes the group the way
the prober does, and times `reconcile_batch` until nothing is left. A second
thread claims (and releases) up to 100 ready rows of the same group in a loop
during the refund, as members do, and reports its worst claim time: refunds
must not block claims for longer than one batch. The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import threading
import time

from sqlalchemy import text

import pgq
from pgq.consumer.prober import RECONCILE_BATCH
from pgq.store import GroupStore, run_once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", default=None, help="libpq DSN (default: $PGQ_DSN / embedded)")
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    schema = f"pgq_rbench_{secrets.token_hex(3)}"
    engine = pgq.connect(args.dsn, schema=schema)
    pgq.migrate(engine)
    try:
        run(engine, schema, args.n)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


def run(engine, schema: str, n: int) -> None:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    for start in range(0, n, 5000):
        pgq.publish_many(engine, "t", [{"i": i} for i in range(start, min(n, start + 5000))])
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery d SET state = 'dead', error_class = 'systemic',"
                " error_epoch = 1, attempts = 5, refundable_attempts = 5"
                f" FROM \"{schema}\".consumer_group g WHERE g.id = d.group_id AND g.name = 'g'"
            )
        )
        conn.execute(
            text(
                f"UPDATE \"{schema}\".breaker b SET state = 'OPEN', epoch = 1"
                f" FROM \"{schema}\".consumer_group g WHERE g.id = b.group_id AND g.name = 'g'"
            )
        )
        conn.execute(text("ANALYZE"))
    info = pgq.store.group_info(engine, "g")
    store = GroupStore(info.id, "g", "t", "bench", 30, 3)
    member = GroupStore(info.id, "g", "t", "claimer", 30, 3)

    stop = threading.Event()
    claim_times: list[float] = []

    def claimer() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            rows = run_once(engine, member.claim, 100, 0)
            claim_times.append(time.perf_counter() - t0)
            run_once(engine, member.release, [r.lease for r in rows])

    close_epoch = run_once(engine, store.close, 1)
    thread = threading.Thread(target=claimer, daemon=True)
    thread.start()
    batches: list[float] = []
    total = 0
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        refunded = run_once(engine, store.reconcile_batch, close_epoch, 0, 3, RECONCILE_BATCH)
        batches.append(time.perf_counter() - t0)
        total += refunded
        if refunded == 0:
            break
    run_once(engine, store.reconcile_done, close_epoch, 0, 3)
    elapsed = time.perf_counter() - started
    stop.set()
    thread.join()
    print(f"refunded {total:,} rows in {elapsed:.2f} s = {total / elapsed:,.0f} rows/s")
    print(
        f"batches of {RECONCILE_BATCH}: {len(batches) - 1} + 1 empty; "
        f"median {statistics.median(batches) * 1000:.0f} ms, max {max(batches) * 1000:.0f} ms"
    )
    if claim_times:
        print(
            f"claims of up to 100 rows of the same group meanwhile: {len(claim_times)}, "
            f"median {statistics.median(claim_times) * 1000:.1f} ms, "
            f"max {max(claim_times) * 1000:.1f} ms"
        )


if __name__ == "__main__":
    main()
