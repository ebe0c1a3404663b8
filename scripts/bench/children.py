"""The code that runs inside the bench's child processes, through pgq's public API.

Every measured phase runs in its own process (import time excluded), started
by the parent as `python scripts/bench --child PHASE --dsn ... --n ... --opts JSON`
(see `harness.child_command`); `child_main` prints the phase's result after the
`RESULT` marker as one line of JSON:

- `enqueue`: `publish_many` of N (untimed setup: schema, topic, one group),
  then optionally single `publish()` calls, pooled and in the caller's
  transaction;
- `consume`: one `Consumer.run(until_empty=True)` over the backlog (optionally
  under py-spy, behind a start barrier, with EXPLAINs before and after);
- `publisher`: publishes with a send timestamp in each payload, at an interval
  or a steady rate (started by `latency` and `sustained`);
- `latency`, `sustained`, `tablesize`: a long-running consumer in this process
  while publishers feed it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import text

import pgq
from scripts.bench import dbstate
from scripts.bench.common import (
    GROUP,
    READY,
    RESULT,
    SCHEMA,
    TOPIC,
    Meter,
    batches,
    busy_cores,
    cpu_s,
    log,
    pct,
    rss_peak_mb,
)
from scripts.bench.harness import collect, spawn_child
from scripts.bench.plans import explain_paths, prepared_plans
from scripts.bench.transactional import child_tx_consume


def _engine(dsn: str, opts: dict) -> Any:
    return pgq.connect(dsn, schema=opts.get("schema", SCHEMA))


def _setup(engine: Any) -> None:
    """Schema, topic and one subscribed group (untimed)."""
    pgq.migrate(engine)
    pgq.create_topic(engine, TOPIC)
    pgq.subscribe(engine, GROUP, TOPIC)


def _payloads(kind: str, rng: range) -> list[Any]:
    if kind == "1k":
        # {"i": n, "pad": "xx..."}: 1,024 bytes of JSON as pgq serialises it
        pad = "x" * (1024 - len('{"i":,"pad":""}') - 7)
        return [{"i": i, "pad": pad} for i in rng]
    return [{"i": i} for i in rng]


def _warm_pool(engine: Any, k: int = 4) -> None:
    """Open `k` pooled connections before the clock (like a booted worker)."""
    conns = [engine.connect() for _ in range(k)]
    for c in conns:
        c.execute(text("SELECT 1"))
    for c in conns:
        c.close()


def _wait_for(pred: Callable[[], bool], timeout: float, step: float = 0.01) -> float | None:
    """Seconds until `pred()` held, or None after `timeout`."""
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(step)
    return time.perf_counter() - t0


class _Running:
    """A Consumer running in a background thread (for latency/sustained/tablesize)."""

    def __init__(
        self,
        engine: Any,
        handler: Callable[[pgq.Message], None],
        workers: int,
        prefetch: int | str | None = None,
    ) -> None:
        extra = {"prefetch": prefetch} if prefetch is not None else {}
        self.consumer = pgq.Consumer(engine, GROUP, handler, workers=workers, **extra)
        self.summary: pgq.RunSummary | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.summary = self.consumer.run()
        except Exception:
            self.error = traceback.format_exc()

    def start(self) -> _Running:
        self.thread.start()
        return self

    def stop(self, timeout: float = 600.0) -> float:
        """Ask to stop, wait; returns the seconds shutdown took (outcome flush included)."""
        t0 = time.perf_counter()
        if self.thread.is_alive():
            # from another thread, stop() only asks the blocking run() to stop
            with contextlib.suppress(pgq.UsageError):
                self.consumer.stop()
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.error = self.error or f"consumer still running {timeout:.0f} s after stop (HANG?)"
        return time.perf_counter() - t0


# -- enqueue ------------------------------------------------------------------


def child_enqueue(dsn: str, n: int, batch: int, opts: dict) -> dict:
    engine = _engine(dsn, opts)
    _setup(engine)
    kind = opts.get("payload", "i")
    chunks = [_payloads(kind, rng) for rng in batches(n, batch)]  # untimed
    _warm_pool(engine, 1)
    with Meter() as m:
        for chunk in chunks:
            pgq.publish_many(engine, TOPIC, chunk)
    out: dict[str, Any] = m.as_dict("enqueue")
    out["payload_bytes"] = len(json.dumps(chunks[0][0], separators=(",", ":")))
    single = int(opts.get("single", 0))
    if single:
        out.update(_single_publishes(engine, n, single, kind))
    return out


def _single_publishes(engine: Any, n: int, single: int, kind: str) -> dict[str, Any]:
    # one publish() per call: with the engine (pool checkout + pre-ping + commit)...
    lat: list[float] = []
    cpu0 = cpu_s()
    t0 = time.perf_counter()
    for i in range(single):
        a = time.perf_counter()
        pgq.publish(engine, TOPIC, _payloads(kind, range(n + i, n + i + 1))[0])
        lat.append(time.perf_counter() - a)
    wall = time.perf_counter() - t0
    out = {
        "single_n": single,
        "single_p50_ms": pct(lat, 50) * 1e3,
        "single_p99_ms": pct(lat, 99) * 1e3,
        "single_max_ms": max(lat) * 1e3,
        "single_per_s": single / wall,
        "single_cpu_us": (cpu_s() - cpu0) * 1e6 / single,
    }
    # ...and inside the caller's transaction on a held connection
    lat = []
    with engine.connect() as conn:
        for i in range(single):
            a = time.perf_counter()
            with conn.begin():
                pgq.publish(conn, TOPIC, _payloads(kind, range(i, i + 1))[0])
            lat.append(time.perf_counter() - a)
    out["single_conn_p50_ms"] = pct(lat, 50) * 1e3
    out["single_conn_p99_ms"] = pct(lat, 99) * 1e3
    return out


# -- consume --------------------------------------------------------------------


def _start_py_spy(opts: dict) -> subprocess.Popen:
    spy = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "-p",
            str(os.getpid()),
            "-f",
            "raw",
            "-o",
            opts["profile_out"],
            "-r",
            str(opts.get("profile_rate", 250)),
            "--nolineno",
            "--nonblocking",
            "--gil",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)  # let py-spy attach before the clock
    return spy


def _consume_handler(
    seen: list[int], stamp: list[float], handler_ms: float
) -> Callable[[pgq.Message], None]:
    """The burn-down's "job": record the id and the time; with `handler_ms` > 0,
    sleep that long first (a slow handler; the no-op one stays as cheap as before)."""
    perf = time.perf_counter

    def handler(msg: pgq.Message) -> None:  # the no-op "job"
        seen.append(msg.id)
        stamp[0] = perf()

    if not handler_ms:
        return handler
    delay = handler_ms / 1000.0

    def slow_handler(msg: pgq.Message) -> None:
        seen.append(msg.id)
        time.sleep(delay)
        stamp[0] = perf()

    return slow_handler


def _consume_config(settings: Any, opts: dict) -> str:
    """The consumer's configuration line: workers, the prefetch used, the handler."""
    pf = opts.get("prefetch")
    eff = settings.effective_prefetch
    prefetch = (
        f"prefetch default ({settings.prefetch!r}, from {eff})"
        if pf is None
        else f"prefetch={pf}" + (f" ({eff})" if pf != eff else "")
    )
    ms = float(opts.get("handler_ms", 0))
    handler = f"sync handler sleeping {ms:g} ms per message" if ms else "sync no-op handler"
    return (
        f"1 Consumer, workers={settings.workers}, {prefetch}, batch_size={settings.batch_size}, "
        f"other settings default; run(until_empty=True); {handler}"
    )


def child_consume(dsn: str, n: int, opts: dict) -> dict:
    workers = int(opts.get("workers", 8))
    engine = _engine(dsn, opts)
    out: dict[str, Any] = {}
    if opts.get("explain"):
        out["explain_before"] = explain_paths(engine)
    seen: list[int] = []
    stamp = [0.0]
    handler = _consume_handler(seen, stamp, float(opts.get("handler_ms", 0)))
    # prefetch only when given, so the Consumer's own default applies otherwise
    extra = {"prefetch": opts["prefetch"]} if opts.get("prefetch") is not None else {}
    consumer = pgq.Consumer(engine, GROUP, handler, workers=workers, **extra)
    _warm_pool(engine, 4)
    spy = _start_py_spy(opts) if opts.get("profile_out") else None
    if opts.get("barrier"):
        # several consumer processes on one backlog: say we are ready (imports
        # done, pool warm), then wait for the parent's go on stdin
        sys.stdout.write(READY + "\n")
        sys.stdout.flush()
        sys.stdin.readline()
    t_start = time.time()
    with Meter() as m:
        summary = consumer.run(until_empty=True)
    out["t_start"], out["t_end"] = t_start, t_start + m.wall
    out["t_last_handler"] = t_start + (stamp[0] - m.t0) if stamp[0] else None
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=60)
            out["profile_stderr"] = (err or "")[-500:]
        except subprocess.TimeoutExpired:
            spy.kill()
    out.update(m.as_dict("consume"))
    out["tail_s"] = m.t1 - stamp[0] if stamp[0] else None
    out.update(handler_calls=len(seen), handler_distinct=len(set(seen)))
    if opts.get("ids"):
        out["ids"] = seen
    out.update(
        summary_handled=summary.handled,
        summary_done=summary.done,
        summary_released=summary.released,
        summary_reclaimed=summary.reclaimed,
        stop_reason=summary.stop_reason,
        clean=consumer.clean,
    )
    out["plans"] = prepared_plans(engine)
    if not opts.get("barrier"):
        out.update(dbstate.db_counts(dsn))  # with several processes the parent counts at the end
    if opts.get("explain"):
        out["explain_after"] = explain_paths(engine)
    s = consumer.settings
    out["prefetch"] = s.prefetch if s.prefetch == "adaptive" else s.effective_prefetch
    out["config"] = _consume_config(consumer.settings, opts)
    return out


# -- publishers and long-running consumers ----------------------------------------


def child_publisher(dsn: str, n: int, opts: dict) -> dict:
    """Publishes with a send timestamp in each payload (for latency/sustained)."""
    engine = _engine(dsn, opts)
    _warm_pool(engine, 1)
    start_at = float(opts.get("start_at", time.time()))
    base = int(opts.get("base", 0))
    while time.time() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - time.time())))
    sent = 0
    t_first = time.time()
    if opts.get("interval"):  # one publish() every `interval` seconds, `n` times
        interval = float(opts["interval"])
        for i in range(n):
            pgq.publish(engine, TOPIC, {"i": base + i, "t": time.time()})
            sent += 1
            delay = start_at + (i + 1) * interval - time.time()
            if delay > 0:
                time.sleep(delay)
    else:  # steady `rate` msgs/s for `duration` s, publish_many of what is due
        rate, duration = float(opts["rate"]), float(opts["duration"])
        tick = float(opts.get("tick", 0.01))
        end = start_at + duration
        while True:
            now = time.time()
            if now >= end:
                break
            due = int((now - start_at) * rate) - sent
            if due <= 0:
                time.sleep(min(tick, end - now))
                continue
            k = min(due, 1000)
            t = time.time()
            pgq.publish_many(engine, TOPIC, [{"i": base + sent + j, "t": t} for j in range(k)])
            sent += k
    t_last = time.time()
    return {"sent": sent, "t_first": t_first, "t_last": t_last, "cpu_s": cpu_s()}


def child_latency(dsn: str, n: int, opts: dict) -> dict:
    engine = _engine(dsn, opts)
    _setup(engine)
    workers = int(opts.get("workers", 8))
    idle_s = float(opts.get("idle_s", 5.0))
    lat: list[float] = []
    seen: list[int] = []

    def handler(msg: pgq.Message) -> None:
        lat.append(time.time() - msg.payload["t"])
        seen.append(msg.id)

    run = _Running(engine, handler, workers).start()
    time.sleep(2.0)  # joined, first maintenance round done
    x0 = dbstate.xacts(dsn)
    c0, t0 = cpu_s(), time.perf_counter()
    time.sleep(idle_s)
    idle_cpu = cpu_s() - c0
    idle_wall = time.perf_counter() - t0
    time.sleep(1.0)  # let the server's statistics catch up (PG flushes them ~1 s)
    x1 = dbstate.xacts(dsn)
    interval = float(opts.get("interval", 0.02))
    pub = spawn_child("publisher", dsn, n, {"interval": interval, "start_at": time.time() + 1.5})
    res = collect(pub, timeout=120 + n * interval)
    waited = _wait_for(lambda: len(seen) >= res.get("sent", n), 30.0)
    stop_s = run.stop()
    out = {
        "idle_s": idle_wall,
        "idle_cpu_pct": idle_cpu / idle_wall * 100.0,
        "idle_xacts_per_s": (x1 - x0 - 2) / (idle_wall + 1.0),  # -2: our own two reads
        "published": res.get("sent"),
        "interval_ms": interval * 1e3,
        "lat_p50_ms": (pct(lat, 50) or 0) * 1e3,
        "lat_p90_ms": (pct(lat, 90) or 0) * 1e3,
        "lat_p99_ms": (pct(lat, 99) or 0) * 1e3,
        "lat_max_ms": max(lat) * 1e3 if lat else None,
        "drained": waited is not None,
        "handler_calls": len(seen),
        "handler_distinct": len(set(seen)),
        "consumer_error": run.error,
        "stop_s": stop_s,
        "workers": workers,
    }
    out.update(dbstate.db_counts(dsn))
    return out


def child_sustained(dsn: str, n: int, opts: dict) -> dict:
    engine = _engine(dsn, opts)
    _setup(engine)
    workers = int(opts.get("workers", 8))
    rate, duration = float(opts["rate"]), float(opts["duration"])
    producers = int(opts.get("producers", 2))
    lat: list[float] = []
    seen: list[int] = []

    def handler(msg: pgq.Message) -> None:
        lat.append(time.time() - msg.payload["t"])
        seen.append(msg.id)

    run = _Running(engine, handler, workers).start()
    time.sleep(1.5)
    start_at = time.time() + 2.5  # publishers import and connect meanwhile
    pubs = [
        spawn_child(
            "publisher",
            dsn,
            0,
            {
                "rate": rate / producers,
                "duration": duration,
                "start_at": start_at,
                "base": k * 10**9,
            },
        )
        for k in range(producers)
    ]
    while time.time() < start_at:
        time.sleep(0.005)
    m0, c0, t0 = psutil.cpu_times(), cpu_s(), time.perf_counter()
    results = [collect(p, timeout=duration + 120) for p in pubs]
    pub_wall = time.perf_counter() - t0
    c1, m1 = cpu_s(), psutil.cpu_times()
    sent = sum(r.get("sent", 0) for r in results)
    handled_at_end = len(seen)
    counts_at_end = dbstate.db_counts(dsn)
    drain = _wait_for(lambda: len(seen) >= sent, 120.0)
    counts_drained = dbstate.db_counts(dsn)
    stop_s = run.stop()
    busy, _ = busy_cores(m0, m1)
    span = max(r["t_last"] for r in results) - min(r["t_first"] for r in results) if results else 0
    out = {
        "target_rate": rate,
        "duration_s": duration,
        "producers": producers,
        "published": sent,
        "achieved_rate": sent / span if span else None,
        "lag_at_end_msgs": sent - handled_at_end,
        "lag_at_end_db": counts_at_end["db_left"],
        "unacked_after_handlers_done": counts_drained["db_left"],
        "stop_s": stop_s,
        "drain_after_end_s": drain,
        "lat_p50_ms": (pct(lat, 50) or 0) * 1e3,
        "lat_p99_ms": (pct(lat, 99) or 0) * 1e3,
        "lat_max_ms": max(lat) * 1e3 if lat else None,
        "consumer_cpu_us_per_msg": (c1 - c0) * 1e6 / handled_at_end if handled_at_end else None,
        "machine_busy_cores": busy,
        "publish_window_s": pub_wall,
        "handler_calls": len(seen),
        "handler_distinct": len(set(seen)),
        "consumer_error": run.error,
        "workers": workers,
        "publisher_errors": [r.get("error") for r in results if not r.get("ok", True)],
    }
    out.update(dbstate.db_counts(dsn))
    return out


def child_tablesize(dsn: str, n: int, opts: dict) -> dict:
    engine = _engine(dsn, opts)
    _setup(engine)
    chunk = int(opts.get("chunk", 100_000))
    workers = int(opts.get("workers", 8))
    bits = bytearray(n + 2)  # message ids are 1..n here
    seen = [0, 0]  # calls, repeats

    def handler(msg: pgq.Message) -> None:
        seen[0] += 1
        if msg.id < len(bits):
            if bits[msg.id]:
                seen[1] += 1
            bits[msg.id] = 1

    def publish(lo: int, k: int) -> None:
        for rng in batches(k, 1000, start=lo):
            pgq.publish_many(engine, TOPIC, [{"i": i} for i in rng])

    rows = []
    t_start = time.perf_counter()
    # the first chunk is published before the consumer starts, then ANALYZEd
    # (untimed, as in the other modes: --no-analyze skips it); later chunks
    # are published into the running consumer
    t0 = time.perf_counter()
    first = min(chunk, n)
    publish(0, first)
    if opts.get("analyze", True):
        dbstate.analyze(dsn)
    run = _Running(engine, handler, workers, opts.get("prefetch")).start()
    done = first
    while True:
        handled = _wait_for(lambda t=done: seen[0] >= t, 1800.0, 0.05)
        resolved = _wait_for(lambda: dbstate.unresolved(dsn) == 0, 1800.0, 0.5)
        row = {
            "messages": done,
            "chunk_s": time.perf_counter() - t0,
            "acks_behind_handlers_s": resolved,
        }
        row.update(dbstate.sizes(dsn))
        rows.append(row)
        log(
            f"  tablesize {done:>9,}: delivery {row['delivery_total_mb']:.1f} MB "
            f"({row['delivery_rows']:,} rows), message {row['message_total_mb']:.1f} MB, "
            f"chunk {row['chunk_s']:.1f} s (acks {resolved or -1:.1f} s behind the handlers)"
        )
        if handled is None or resolved is None or done >= n:
            break
        t0 = time.perf_counter()
        k = min(chunk, n - done)
        publish(done, k)
        done += k
    time.sleep(3.0)  # one more frontier round
    stop_s = run.stop()
    final = {"messages": done, "chunk_s": None, "after_stop": True}
    final.update(dbstate.sizes(dsn))
    rows.append(final)
    out = {
        "rows": rows,
        "total_s": time.perf_counter() - t_start,
        "handler_calls": seen[0],
        "handler_distinct": seen[0] - seen[1],
        "chunk": chunk,
        "workers": workers,
        "consumer_error": run.error,
        "stop_s": stop_s,
        "reloptions": dbstate.reloptions(dsn),
    }
    out.update(dbstate.db_counts(dsn))
    return out


CHILDREN: dict[str, Callable[[Any, dict], dict]] = {
    "enqueue": lambda a, o: child_enqueue(a.dsn, a.n, a.batch, o),
    "consume": lambda a, o: child_consume(a.dsn, a.n, o),
    "publisher": lambda a, o: child_publisher(a.dsn, a.n, o),
    "latency": lambda a, o: child_latency(a.dsn, a.n, o),
    "sustained": lambda a, o: child_sustained(a.dsn, a.n, o),
    "tablesize": lambda a, o: child_tablesize(a.dsn, a.n, o),
    "tx-consume": lambda a, o: child_tx_consume(a.dsn, a.n, o),
}


def child_main(args: Any) -> int:
    """Run phase `args.child`; print its result (or the traceback) after `RESULT`."""
    opts = json.loads(args.opts or "{}")
    try:
        out = CHILDREN[args.child](args, opts)
        out["rss_peak_mb"] = rss_peak_mb()
        out["ok"] = True
    except Exception:
        out = {"ok": False, "error": traceback.format_exc()}
    sys.stdout.write("\n" + RESULT + json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
    return 0
