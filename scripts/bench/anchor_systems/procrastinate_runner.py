"""procrastinate: a psycopg 3 pool, one worker, an async task.

Enqueue: `task.batch_defer_async(*kwargs)` (one `procrastinate_defer_jobs_v1`
call per batch). Consume: `App.run_worker_async(concurrency=...,
wait=False)`, procrastinate's "stop once nothing is left" mode, on a pool of
concurrency + 2 connections warmed before the clock. Procrastinate fetches and
finishes one job per round trip by design. Done = `status = 'succeeded'`
(jobs are kept: the default `delete_jobs=never`).
"""

from __future__ import annotations

import asyncio

import procrastinate
import psycopg

from scripts.bench.common import Meter, batches

TASK = "noop"


def _app(dsn: str, seen: list[int] | None, pool_size: int) -> tuple[procrastinate.App, object]:
    connector = procrastinate.PsycopgConnector(
        conninfo=dsn, min_size=min(4, pool_size), max_size=pool_size
    )
    app = procrastinate.App(connector=connector)

    @app.task(name=TASK)
    async def noop(i: int) -> None:
        if seen is not None:
            seen.append(i)

    return app, noop


def enqueue(dsn: str, n: int, batch: int, opts: dict) -> dict:
    async def main() -> dict:
        app, noop = _app(dsn, None, 4)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            kwargs = [{"i": i} for i in range(n)]  # outside the clock
            with Meter() as m:
                for rng in batches(n, batch):
                    await noop.batch_defer_async(*kwargs[rng.start : rng.stop])  # type: ignore[attr-defined]
        return m.as_dict("enqueue")

    return asyncio.run(main())


def consume(dsn: str, n: int, opts: dict) -> dict:
    concurrency = int(opts.get("concurrency", 10))
    pool_size = concurrency + 2  # fetcher + listener + the finishing jobs

    async def main() -> dict:
        seen: list[int] = []
        app, _ = _app(dsn, seen, pool_size)
        async with app.open_async():
            await app.connector.pool.wait()  # type: ignore[attr-defined]
            with Meter() as m:
                await app.run_worker_async(
                    concurrency=concurrency, wait=False, install_signal_handlers=False
                )
        return {
            **m.as_dict("consume"),
            "handler_calls": len(seen),
            "handler_distinct": len(set(seen)),
        }

    out = asyncio.run(main())
    with psycopg.connect(dsn) as conn:
        done, distinct, left = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'succeeded'),"
            " count(DISTINCT id) FILTER (WHERE status = 'succeeded'),"
            " count(*) FILTER (WHERE status <> 'succeeded') FROM procrastinate_jobs"
        ).fetchone()
    out.update(
        db_done=done,
        db_done_distinct=distinct,
        db_left=left,
        config=f"1 worker, concurrency={concurrency}, psycopg pool max {pool_size}, "
        "wait=False, async no-op task, asyncio loop",
    )
    return out
