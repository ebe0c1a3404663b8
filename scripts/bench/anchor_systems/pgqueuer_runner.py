"""pgqueuer, as its own `pgq run` CLI runs it: asyncpg, uvloop, an async entrypoint.

Enqueue: `Queries.enqueue` with lists of entrypoints, payloads and priorities
(pgqueuer's batch form, one INSERT over `unnest` per call). Consume: one
`PgQueuer` per worker (`workers`, default 1), each on its own asyncpg
connection, `run(batch_size=..., mode=drain)`: it returns once the queue is
empty and its jobs' outcomes are written. Done = the job's row gone from
`pgqueuer` and a `successful` row for it in `pgqueuer_log`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries
from pgqueuer.types import QueueExecutionMode

from scripts.bench.common import Meter, batches

ENTRYPOINT = "noop"


def _run(coro: Coroutine[Any, Any, dict]) -> dict:
    try:
        import uvloop
    except ImportError:  # pgqueuer runs on asyncio without it
        return asyncio.run(coro)
    return uvloop.run(coro)


def enqueue(dsn: str, n: int, batch: int, opts: dict) -> dict:
    async def main() -> dict:
        conn = await asyncpg.connect(dsn)
        try:
            queries = Queries(AsyncpgDriver(conn))
            await queries.install()
            bodies = [json.dumps({"i": i}).encode() for i in range(n)]  # outside the clock
            with Meter() as m:
                for rng in batches(n, batch):
                    k = len(rng)
                    await queries.enqueue([ENTRYPOINT] * k, bodies[rng.start : rng.stop], [0] * k)
        finally:
            await conn.close()
        return m.as_dict("enqueue")

    return _run(main())


def consume(dsn: str, n: int, opts: dict) -> dict:
    workers = int(opts.get("workers", 1))
    batch_size = int(opts.get("batch_size", 10))

    async def main() -> dict:
        seen: list[int] = []
        managers = []
        conns = []
        for _ in range(workers):  # connections and managers built untimed
            conn = await asyncpg.connect(dsn)
            conns.append(conn)
            manager = PgQueuer(AsyncpgDriver(conn))

            @manager.entrypoint(ENTRYPOINT)
            async def noop(job: Job) -> None:
                seen.append(job.id)

            managers.append(manager)
        with Meter() as m:
            await asyncio.gather(
                *(q.run(batch_size=batch_size, mode=QueueExecutionMode.drain) for q in managers)
            )
        for conn in conns:
            await conn.close()
        conn = await asyncpg.connect(dsn)
        try:
            done = await conn.fetchrow(
                "SELECT count(*) AS n, count(DISTINCT job_id) AS d"
                " FROM pgqueuer_log WHERE status = 'successful'"
            )
            left = await conn.fetchval("SELECT count(*) FROM pgqueuer")
        finally:
            await conn.close()
        return {
            **m.as_dict("consume"),
            "handler_calls": len(seen),
            "handler_distinct": len(set(seen)),
            "db_done": done["n"],
            "db_done_distinct": done["d"],
            "db_left": left,
            "config": f"{workers} PgQueuer x 1 asyncpg conn, batch_size={batch_size}, "
            "mode=drain, async no-op entrypoint, uvloop",
        }

    return _run(main())
