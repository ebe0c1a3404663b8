# ruff: noqa: E501  (progress lines read better unwrapped)
"""The modes: what runs, in which databases, in which order; raw results into the report.

Each mode takes the server, the parsed arguments and the report (the `--json`
object, which it fills in), runs its children round-robin over the
repetitions, logs one progress line per run, and returns its markdown section
(from `render`).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench import dbstate, render
from scripts.bench.anchors import (
    ANCHOR_SYSTEMS,
    anchor_child,
    anchor_versions,
    ensure_anchors_venv,
)
from scripts.bench.common import consumer_opts, log, med, prefetch_label, shares_text
from scripts.bench.harness import Server, consume_procs, exactly_once, fail_text, pgq_child
from scripts.bench.profiling import analyze_profile


def pgq_name(w: int, prefetch: int | str | None = None) -> str:
    """`pgq-w8`, or `pgq-w8-p50` with `--prefetch 50`."""
    return f"pgq-w{w}" + (f"-p{prefetch}" if prefetch is not None else "")


def knobs_label(args: Any) -> str:
    """` prefetch default` / ` prefetch=50`, plus ` handler 100 ms` with --handler-ms."""
    ms = f" handler {args.handler_ms:g} ms" if args.handler_ms else ""
    return f" {prefetch_label(args.prefetch)}{ms}"


def entry_opts(args: Any, workers: int, prefetch: int | str | None) -> dict[str, Any]:
    """A compare entry's consumer options: the flags', with this entry's prefetch
    (None: not passed, the Consumer's default)."""
    opts = consumer_opts(args, workers)
    opts.pop("prefetch", None)
    if prefetch is not None:
        opts["prefetch"] = prefetch
    return opts


def mode_compare(srv: Server, args: Any, report: dict) -> list[str]:
    """pgq (one entry per --workers value, and per --compare-prefetch value) and the
    anchors: publish, ANALYZE, drain."""
    n = args.n[0]
    names = args.systems.split(",") if args.systems else ANCHOR_SYSTEMS
    anchors = [s for s in names if s and s != "none"]
    if anchors:
        ensure_anchors_venv(args)
    prefetches = args.compare_prefetch or [args.prefetch]
    entries: list[tuple[str, Any, Any]] = [(s, None, None) for s in anchors] + [
        (pgq_name(w, pf), w, pf) for w in args.workers for pf in prefetches
    ]
    raw: dict[str, list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for name, w, pf in entries:
            db = f"cmp_{name.replace('-', '_')}_{rep}"
            with srv.database(db) as dsn:
                if w is None:
                    e = anchor_child("enqueue", name, dsn, n, args)
                else:
                    e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
                if e.get("ok") and args.analyze:
                    dbstate.analyze(dsn)
                if e.get("ok"):
                    c = (
                        anchor_child("consume", name, dsn, n, args)
                        if w is None
                        else pgq_child("consume", dsn, n, entry_opts(args, w, pf), args)
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
                    f"{'; plans generic/custom ' + render.plans_text(c) if c.get('plans') else ''}) "
                    f"{'OK' if not run['problems'] else run['problems']}"
                )
            else:
                log(f"[{rep}] {name}: FAILED\n{fail_text(e)}\n{fail_text(c)}")
            raw[name].append(run)
    report["compare"] = {
        "n": n,
        "reps": args.reps,
        "analyze": args.analyze,
        "systems": {name: _compare_summary(raw[name]) for name, _, _ in entries},
        "anchor_versions": anchor_versions(args) if anchors else {},
        "raw": raw,
    }
    return render.render_compare(report["compare"], args)


def _compare_summary(runs: list[dict]) -> dict[str, Any]:
    """Medians of one entry's runs (or the error of its first run)."""
    good = [r for r in runs if r["enqueue"].get("ok") and r["consume"].get("ok")]
    s: dict[str, Any] = {"runs_ok": bool(good) and len(good) == len(runs)}
    if not good:
        r0 = runs[0]
        s["error"] = (fail_text(r0["consume"]) or fail_text(r0["enqueue"]) or "?").splitlines()[-1]
        return s
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
    return s


def mode_publish(srv: Server, args: Any, report: dict) -> list[str]:
    """`publish_many` throughput per payload kind, then single `publish()` latency."""
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
                log(f"[{rep}] publish {kind}: FAILED\n{fail_text(r)}")
            raw[kind].append(r)
    report["publish"] = {"n": n, "raw": raw}
    return render.render_publish(raw, n, args)


def _consume_runs(
    srv: Server,
    args: Any,
    ns: list[int],
    workers: list[int],
    tag: str,
    explain: bool = False,
    procs: list[int] | None = None,
    knobs: bool = False,
) -> dict[tuple[int, int, int], list[dict]]:
    """Burn-downs: for each rep, N, workers (and process count), a fresh database,
    `publish_many` of N, an untimed ANALYZE, then the drain. Without `procs` ONE
    consumer child (optionally with EXPLAIN); with `procs` that many consumer
    processes started together (`consume_procs`). With `knobs` the consumers get
    --handler-ms and --prefetch."""
    raw: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for n in ns:
            for w in workers:
                copts = consumer_opts(args, w) if knobs else {"workers": w}
                for k in procs or [1]:
                    with srv.database(f"{tag}_{n}_{w}_{k}_{rep}") as dsn:
                        e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
                        if e.get("ok") and args.analyze:
                            dbstate.analyze(dsn)
                        if not e.get("ok"):
                            c = {"ok": False, "error": "enqueue failed"}
                        elif procs:
                            c = consume_procs(dsn, n, copts, k, args)
                        else:
                            opts = {**copts, "explain": explain and rep == 0}
                            c = pgq_child("consume", dsn, n, opts, args)
                    run = {"rep": rep, "n": n, "workers": w, "procs": k, "enqueue": e, "consume": c}
                    label = (
                        f"[{rep}] {tag} N={n:,} workers={w}"
                        + (f" procs={k}" if procs else "")
                        + (knobs_label(args) if knobs else "")
                    )
                    if e.get("ok") and c.get("ok"):
                        run["problems"] = exactly_once(n, c)
                        run["enqueue_msgs_s"] = n / e["enqueue_s"]
                        run["consume_msgs_s"] = n / c["consume_s"]
                        extra = (
                            f", per process {shares_text(c['per_proc_handled'])}, start spread "
                            f"{c['start_spread_s'] * 1e3:.0f} ms"
                            if procs and k > 1
                            else ""
                        )
                        log(
                            f"{label}: publish {run['enqueue_msgs_s']:,.0f}/s, consume "
                            f"{run['consume_msgs_s']:,.0f}/s ({c['consume_s']:.2f}s, cpu "
                            f"{c['consume_client_cpu_s'] * 1e6 / n:.0f} µs/msg, busy {c['consume_machine_busy_cores']:.2f}, "
                            f"tail {c.get('tail_s') or 0:.2f}s{extra}; plans generic/custom {render.plans_text(c)}) "
                            f"{'OK' if not run['problems'] else run['problems']}"
                        )
                    else:
                        log(f"{label}: FAILED\n{fail_text(e)}\n{fail_text(c)}")
                    raw[(n, w, k)].append(run)
    return raw


def mode_consume(srv: Server, args: Any, report: dict) -> list[str]:
    """Burn-downs of N by --procs consumer processes of --workers each."""
    raw = _consume_runs(srv, args, args.n, args.workers, "con", procs=args.procs, knobs=True)
    report["consume"] = {"raw": {f"{n}/{w}/{k}": v for (n, w, k), v in raw.items()}}
    return render.render_consume(raw, args)


def mode_backlog(srv: Server, args: Any, report: dict) -> list[str]:
    """Drain a small and a big backlog, with EXPLAINs of the claim and the ack."""
    ns = args.n if len(args.n) > 1 else [20_000, args.n[0] if args.n[0] != 20_000 else 1_000_000]
    w = args.workers[:1]
    raw = _consume_runs(srv, args, ns, w, "bl", explain=True, knobs=True)
    report["backlog"] = {"raw": {f"{n}/{ww}": v for (n, ww, _), v in raw.items()}}
    return render.render_backlog(raw, ns, w[0], args)


def mode_latency(srv: Server, args: Any, report: dict) -> list[str]:
    """Idle consumer CPU, then publish-to-handler latency at a slow steady pace."""
    raw = []
    for rep in range(args.reps):
        opts = {"workers": args.workers[0], "interval": args.interval, "idle_s": args.idle_seconds}
        with srv.database(f"lat_{rep}") as dsn:
            r = pgq_child("latency", dsn, args.latency_msgs, opts, args)
        if r.get("ok"):
            r["problems"] = exactly_once(r.get("published") or -1, r)
            log(
                f"[{rep}] latency p50 {r['lat_p50_ms']:.2f} ms p99 {r['lat_p99_ms']:.2f} ms max "
                f"{r['lat_max_ms']:.1f} ms; idle CPU {r['idle_cpu_pct']:.2f} % of a core, "
                f"{r['idle_xacts_per_s']:.1f} xact/s {'OK' if not r['problems'] else r['problems']}"
            )
        else:
            log(f"[{rep}] latency FAILED\n{fail_text(r)}")
        raw.append(r)
    report["latency"] = {"raw": raw}
    return render.render_latency(raw, args)


def mode_sustained(srv: Server, args: Any, report: dict) -> list[str]:
    """Producers at a steady rate while one consumer keeps up, per --rate."""
    raw: dict[float, list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for rate in args.rate:
            opts = {
                "workers": args.workers[0],
                "rate": rate,
                "duration": args.duration,
                "producers": args.producers,
            }
            with srv.database(f"sus_{int(rate)}_{rep}") as dsn:
                r = pgq_child("sustained", dsn, 0, opts, args)
            if r.get("ok"):
                r["problems"] = exactly_once(r["published"], r)
                log(
                    f"[{rep}] sustained target {rate:,.0f}/s: achieved {r['achieved_rate'] or 0:,.0f}/s, lag at end "
                    f"{r['lag_at_end_msgs']:,}, p50 {r['lat_p50_ms']:.1f} ms p99 {r['lat_p99_ms']:.1f} ms, cpu "
                    f"{r['consumer_cpu_us_per_msg'] or 0:.0f} µs/msg {'OK' if not r['problems'] else r['problems']}"
                )
            else:
                log(f"[{rep}] sustained {rate}: FAILED\n{fail_text(r)}")
            raw[rate].append(r)
    report["sustained"] = {"raw": {str(k): v for k, v in raw.items()}}
    return render.render_sustained(raw, args)


def mode_tablesize(srv: Server, args: Any, report: dict) -> list[str]:
    """--total messages in --chunk chunks through one long-running consumer."""
    opts = {**consumer_opts(args, args.workers[0]), "chunk": args.chunk, "analyze": args.analyze}
    long = argparse.Namespace(**{**vars(args), "timeout": max(args.timeout, 3600)})
    with srv.database("tablesize") as dsn:
        r = pgq_child("tablesize", dsn, args.total, opts, long)
    if r.get("ok"):
        r["problems"] = exactly_once(args.total, r)
    else:
        log(f"tablesize FAILED\n{fail_text(r)}")
    report["tablesize"] = r
    return render.render_tablesize(r, args)


def mode_profile(srv: Server, args: Any, report: dict) -> list[str]:
    """One burn-down under py-spy; CPU per message by thread role."""
    n, w = args.n[0], args.workers[0]
    out = args.profile_out or str(Path(tempfile.gettempdir()) / f"pgq-consume-{n}-w{w}.pyspy.txt")
    out = str(Path(out).resolve())
    with srv.database("prof") as dsn:
        e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
        if args.analyze:
            dbstate.analyze(dsn)
        opts = {"workers": w, "profile_out": out, "profile_rate": args.profile_rate}
        c = pgq_child("consume", dsn, n, opts, args)
    if not (e.get("ok") and c.get("ok")) or not Path(out).exists():
        log(f"profile FAILED\n{fail_text(e)}\n{fail_text(c)}")
        report["profile"] = {"ok": False, "enqueue": e, "consume": c}
        return ["## profile", "", "FAILED: " + (fail_text(c) or fail_text(e))[-300:]]
    prof = analyze_profile(out, args.profile_rate, n)
    report["profile"] = {"ok": True, "consume": c, "analysis": prof, "raw_file": out}
    return render.render_profile(prof, c, n, w, out, args)


MODES: dict[str, Callable[[Server, Any, dict], list[str]]] = {
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
"""Modes whose --n default differs from the general 20,000."""


def all_ok(report: dict) -> bool:
    """Every run of every mode succeeded and passed its exactly-once checks."""
    ok = True
    c = report.get("compare")
    if c:
        ok &= all(s.get("runs_ok") and s.get("exactly_once") for s in c["systems"].values())
    for runs in (report.get("publish") or {}).get("raw", {}).values():
        ok &= all(r.get("ok") for r in runs)
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
    if "profile" in report:
        ok &= bool(report["profile"].get("ok"))
    if "server_cpu" in report:  # `targets`
        ok &= bool(report["server_cpu"])
    return bool(ok)
