# ruff: noqa: E501  (progress lines and markdown rows read better unwrapped)
"""The mode `transactional`: what committing the effect with the ack costs (issue 22).

Three consumers drain the same backlog (a fresh database each, repetitions
round-robin over them), each with a handler whose job is to insert one row per
message into `effect` (`message_id` primary key, the payload's `i`) in the same
database:

- `plain`: `Consumer(engine, group, handler)`, the handler opening its own
  transaction on the engine (`with engine.begin()`) for its one `INSERT`: what a
  user writes without pgq's help (effect and ack are two commits; a crash
  between them runs the message again);
- `tx-single`: `Consumer(..., transactional=True)`, `handler(msg, conn)` inserts
  its row in pgq's transaction, which commits it with the message's `done`;
- `tx-batch`: `Consumer(..., batch_handler=fn, transactional=True)`, `fn(msgs,
  conn)` inserts the batch's rows with one multi-row `INSERT`, one commit for the
  batch.

The exactly-once checks are the other modes' (the handler saw N distinct ids,
the database holds N done rows, nothing left) plus the effect: `effect` holds N
rows, one per message. The table reports msgs/s (median, min–max), the client's
CPU per message, the mean batch the batch handler got, and each against `plain`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import column, insert, table, text

import pgq
from scripts.bench import dbstate
from scripts.bench.common import GROUP, SCHEMA, Meter, log, med
from scripts.bench.harness import Server, exactly_once, fail_text, pgq_child

KINDS = ("plain", "tx-single", "tx-batch")
"""The three consumers, in the order each repetition runs them."""

EFFECT_DDL = "CREATE TABLE effect (message_id bigint PRIMARY KEY, i integer NOT NULL)"


# -- the child ------------------------------------------------------------------


def child_tx_consume(dsn: str, n: int, opts: dict) -> dict:
    """One drain of the backlog by the consumer `opts["kind"]` (see the module)."""
    kind = opts["kind"]
    workers = int(opts.get("workers", 8))
    engine = pgq.connect(dsn, schema=SCHEMA)
    with engine.begin() as c:  # untimed
        c.execute(text(EFFECT_DDL))
    effect = table("effect", column("message_id"), column("i"))
    seen: list[int] = []
    calls = [0]

    def plain(msg: pgq.Message) -> None:
        with engine.begin() as conn:
            conn.execute(insert(effect).values(message_id=msg.id, i=msg.payload["i"]))
        seen.append(msg.id)

    def single(msg: pgq.Message, conn: Any) -> None:
        conn.execute(insert(effect).values(message_id=msg.id, i=msg.payload["i"]))
        seen.append(msg.id)

    def batch(msgs: list[pgq.Message], conn: Any) -> None:
        conn.execute(insert(effect), [{"message_id": m.id, "i": m.payload["i"]} for m in msgs])
        seen.extend(m.id for m in msgs)
        calls[0] += 1

    if kind == "plain":
        consumer = pgq.Consumer(engine, GROUP, plain, workers=workers)
    elif kind == "tx-single":
        consumer = pgq.Consumer(engine, GROUP, single, workers=workers, transactional=True)
    elif kind == "tx-batch":
        consumer = pgq.Consumer(
            engine, GROUP, batch_handler=batch, workers=workers, transactional=True
        )
    else:
        raise ValueError(f"unknown kind {kind!r}")
    warm = [engine.connect() for _ in range(workers)]  # a booted worker's pool
    for c in warm:
        c.execute(text("SELECT 1"))
        c.close()
    with Meter() as m:
        summary = consumer.run(until_empty=True)
    out: dict[str, Any] = m.as_dict("consume")
    out.update(handler_calls=len(seen), handler_distinct=len(set(seen)))
    out["batch_calls"] = calls[0]
    out.update(
        summary_handled=summary.handled,
        summary_done=summary.done,
        stop_reason=summary.stop_reason,
        clean=consumer.clean,
    )
    with engine.connect() as c:
        out["effect_rows"], out["effect_distinct"] = c.execute(
            text("SELECT count(*), count(DISTINCT message_id) FROM effect")
        ).one()
    engine.dispose()
    out.update(dbstate.db_counts(dsn))
    s = consumer.settings
    out["config"] = (
        f"1 Consumer, workers={s.workers}, batch_size={s.batch_size}, prefetch {s.prefetch!r}, "
        "other settings default; run(until_empty=True)"
    )
    return out


# -- the mode ---------------------------------------------------------------------


def effect_problems(n: int, c: dict) -> list[str]:
    """The effect table must hold one row per message, no more, no fewer."""
    return [f"{k}={c.get(k)} != {n}" for k in ("effect_rows", "effect_distinct") if c.get(k) != n]


def mode_transactional(srv: Server, args: Any, report: dict) -> list[str]:
    """The three consumers of the module on N messages, `--reps` rounds interleaved."""
    n, w = args.n[0], args.workers[0]
    raw: dict[str, list[dict]] = defaultdict(list)
    for rep in range(args.reps):
        for kind in KINDS:
            with srv.database(f"tx_{kind.replace('-', '_')}_{rep}") as dsn:
                e = pgq_child("enqueue", dsn, n, {"payload": "i"}, args)
                if e.get("ok") and args.analyze:
                    dbstate.analyze(dsn)
                if e.get("ok"):
                    c = pgq_child("tx-consume", dsn, n, {"kind": kind, "workers": w}, args)
                else:
                    c = {"ok": False, "error": "enqueue failed"}
            run: dict[str, Any] = {"rep": rep, "enqueue": e, "consume": c}
            if e.get("ok") and c.get("ok"):
                run["problems"] = exactly_once(n, c) + effect_problems(n, c)
                run["consume_msgs_s"] = n / c["consume_s"]
                batches = f", {n / c['batch_calls']:.1f} msgs/batch" if c.get("batch_calls") else ""
                log(
                    f"[{rep}] {kind:9s} {run['consume_msgs_s']:>8,.0f} msgs/s ({c['consume_s']:.2f}s, cpu "
                    f"{c['consume_client_cpu_s'] * 1e6 / n:.0f} µs/msg, busy {c['consume_machine_busy_cores']:.2f}"
                    f"{batches}) {'OK' if not run['problems'] else run['problems']}"
                )
            else:
                log(f"[{rep}] {kind}: FAILED\n{fail_text(e)}\n{fail_text(c)}")
            raw[kind].append(run)
    report["transactional"] = {"n": n, "workers": w, "reps": args.reps, "raw": raw}
    return render_transactional(raw, n, w, args)


def all_ok(report: dict) -> bool:
    """Every run of the mode drained and passed its checks (True when it did not run)."""
    runs = [r for rs in (report.get("transactional") or {}).get("raw", {}).values() for r in rs]
    return all(r.get("consume", {}).get("ok") and not r.get("problems") for r in runs)


def render_transactional(raw: dict[str, list[dict]], n: int, w: int, args: Any) -> list[str]:
    L = [
        "## Transactional handlers",
        "",
        f"N = {n:,} messages, one consumer process, workers={w}, other settings default; "
        f"{args.reps} repetitions round-robin over the three (a fresh database each); medians "
        "(min–max). Each handler inserts one row per message into `effect` in the same "
        "database: `plain` in its own `engine.begin()` transaction, `tx-single` in pgq's "
        "transaction (`transactional=True`), `tx-batch` with one multi-row `INSERT` per batch "
        "(`batch_handler=`). Ratios are against `plain`; per-rep = paired runs of one repetition.",
        "",
        "| consumer | msgs/s | / plain | client CPU µs/msg | msgs per batch | exactly once (effect rows = N) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    base = [r.get("consume_msgs_s") for r in raw.get("plain", [])]
    base_med = med(base)
    for kind in KINDS:
        runs = raw.get(kind, [])
        good = [r for r in runs if "consume_msgs_s" in r]
        if not good:
            err = fail_text(runs[0]["consume"]) if runs else "not run"
            L.append(f"| `{kind}` | FAILED: {err.splitlines()[-1] if err else '?'} | | | | |")
            continue
        rates = [r["consume_msgs_s"] for r in good]
        cpu = med([r["consume"]["consume_client_cpu_s"] * 1e6 / n for r in good])
        calls = med([r["consume"].get("batch_calls") or None for r in good])
        ratio = "1.00"
        if kind != "plain" and base_med:
            paired = [a / b for a, b in zip(rates, base, strict=False) if a and b]
            ratio = f"**{med(rates) / base_med:.2f}**" + (
                f" ({min(paired):.2f}–{max(paired):.2f})" if paired else ""
            )
        problems = sorted({p for r in good for p in r["problems"]})
        ok = "yes" if not problems and len(good) == len(runs) else "NO: " + "; ".join(problems)
        L.append(
            f"| `{kind}` | {med(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f}) | {ratio} | "
            f"{cpu:.0f} | {f'{n / calls:.1f}' if calls else '1'} | {ok} |"
        )
    return L
