"""awa (the `awa-pg` wheel: PyO3 bindings of the Rust awa queue), at its defaults.

Setup (untimed): `migrate()`, then `install_queue_storage()`, which makes awa's
queue-storage engine the active one (a fresh `migrate()` leaves the canonical
engine active, and `enqueue_many_copy` refuses to run on it). Enqueue:
`enqueue_many_copy` of `Noop(i)` dataclasses, one COPY per batch. Consume: one
`AsyncClient` (pool of 10 connections), `start([(queue, workers)])` with the
default poll interval and claim settings, an async no-op handler.

awa has no "stop when the queue is empty" mode, so the timed interval runs
from `start()` until the handler has seen N jobs and `shutdown()` (which
drains the in-flight ones) has returned; a run that stops making progress for
`stall_s` seconds is stopped and reported short. awa writes completions into
its receipt plane rather than one done row per job, so the database side of
the check reads awa's own counters (`queue_stats`): `db_done` and
`db_done_distinct` are both its completed count for the queue, `db_left` its
queued + running + failed + retryable jobs; the distinct ids come from the
handler.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import awa

from scripts.bench.common import Meter, batches

QUEUE = "bench"


@dataclass
class Noop:
    i: int


def _awa_dsn(dsn: str) -> str:
    """The DSN with a host name: awa's Rust driver rejects libpq's empty host
    (`postgresql://user:@/db?host=/socket/dir`); its `host` parameter still
    picks the Unix socket."""
    parts = urlsplit(dsn)
    if parts.hostname:
        return dsn
    user = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    netloc = f"{user.rstrip(':')}@localhost" if user else "localhost"
    return urlunsplit(parts._replace(netloc=netloc))


def enqueue(dsn: str, n: int, batch: int, opts: dict) -> dict:
    async def main() -> dict:
        client = awa.AsyncClient(_awa_dsn(dsn))
        try:
            await client.migrate()
            await client.install_queue_storage()
            jobs = [Noop(i) for i in range(n)]  # outside the clock
            with Meter() as m:
                for rng in batches(n, batch):
                    await client.enqueue_many_copy(jobs[rng.start : rng.stop], queue=QUEUE)
        finally:
            await client.close()
        return m.as_dict("enqueue")

    return asyncio.run(main())


def consume(dsn: str, n: int, opts: dict) -> dict:
    workers = int(opts.get("workers", 10))
    stall_s = float(opts.get("stall_s", 30))

    async def main() -> dict:
        seen: list[int] = []
        all_seen = asyncio.Event()
        client = awa.AsyncClient(_awa_dsn(dsn))

        @client.task(Noop, queue=QUEUE)
        async def noop(job: awa.Job) -> None:
            seen.append(job.id)
            if len(seen) >= n:
                all_seen.set()

        try:
            with Meter() as m:
                await client.start([(QUEUE, workers)])
                before = -1
                while not all_seen.is_set() and len(seen) != before:
                    before = len(seen)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(all_seen.wait(), stall_s)
                await client.shutdown()
            stats = {s.queue: s for s in await client.queue_stats()}
        finally:
            await client.close()
        s = stats.get(QUEUE)
        done = s.completed_last_hour if s else 0
        left = (s.total_queued + s.running + s.failed + s.retryable) if s else 0
        return {
            **m.as_dict("consume"),
            "handler_calls": len(seen),
            "handler_distinct": len(set(seen)),
            "db_done": done,
            "db_done_distinct": done,
            "db_left": left,
            "config": f"1 AsyncClient, queue of {workers} workers, default poll/claim settings, "
            "queue storage, async no-op handler, asyncio loop; stopped at N handled + shutdown()",
        }

    return asyncio.run(main())
