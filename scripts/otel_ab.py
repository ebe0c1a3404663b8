"""What the `otel` extra costs on the hot path: `scripts/bench` runs of pgq alone,
interleaved, under three set-ups of this checkout (and, with `--before PATH`, a
checkout without `pgq.otel` as a fourth):

- `off`: `opentelemetry` made unimportable (a `sitecustomize` import blocker),
  as without the extra;
- `api`: the extra installed, no tracer provider set (the API's default);
- `sdk`: an SDK tracer provider set, spans batched to an exporter that drops
  them: every handler call a recorded CONSUMER span.

    .venv/bin/python scripts/otel_ab.py --rounds 5 [--before ../main]

Each round runs every set-up once (`consume --systems none --reps 1`, then
`publish --payload i --single 1000 --reps 1`); it prints the medians and their
ratios to `off`. With `--dsn DSN` it then times `publish()` inside an active span
(an SDK provider set, in this process), pgq's PRODUCER span and injection on and
off in turn. Decision 0043, docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCK = """
import sys


class _Blocker:
    def find_spec(self, name, *args):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")


sys.meta_path.insert(0, _Blocker())
"""

SDK = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult


class _Drop(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(_Drop()))
trace.set_tracer_provider(provider)
"""


def run(tree: Path, site: Path | None, args: list[str], out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    cmd = [sys.executable, str(tree / "scripts" / "bench"), *args, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def publish_in_span(dsn: str, rounds: int, calls: int = 400) -> None:
    """`publish()` in an active span, with pgq's tracing on and off in turn."""
    import psycopg
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    sys.path.insert(0, str(ROOT))
    import pgq
    from pgq.otel import tracing

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)
    schema = f"otel_ab_{os.getpid()}"
    engine = pgq.connect(dsn, schema=schema)
    pgq.migrate(engine)
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    tracer = trace.get_tracer("otel_ab")
    found: dict[str, list[tuple[float, float]]] = {"untraced": [], "traced": []}
    try:
        for r in range(rounds):
            for name in found if r % 2 == 0 else list(reversed(found)):
                tracing.TRACING = name == "traced"
                wall, cpu = time.perf_counter(), time.process_time()
                with tracer.start_as_current_span("request"):
                    for i in range(calls):
                        pgq.publish(engine, "t", {"i": i})
                found[name].append(
                    (
                        (time.perf_counter() - wall) / calls * 1e3,
                        (time.process_time() - cpu) / calls * 1e6,
                    )
                )
    finally:
        engine.dispose()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    print(f"\npublish() inside a span, {calls} calls x {rounds} rounds (medians):")
    for name, values in found.items():
        ms = statistics.median(v[0] for v in values)
        us = statistics.median(v[1] for v in values)
        print(f"  pgq {name}: {ms:.3f} ms/call, {us:.0f} µs CPU/call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--before", type=Path, help="a checkout without pgq.otel (the baseline)")
    ap.add_argument("--dsn", help="also time publish() in a span on this libpq DSN")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="otel-ab-"))
    sites = {"off": tmp / "off", "sdk": tmp / "sdk"}
    for name, text in (("off", BLOCK), ("sdk", SDK)):
        sites[name].mkdir()
        (sites[name] / "sitecustomize.py").write_text(text)
    setups: dict[str, tuple[Path, Path | None]] = {
        "off": (ROOT, sites["off"]),
        "api": (ROOT, None),
        "sdk": (ROOT, sites["sdk"]),
    }
    if a.before is not None:
        setups = {"before": (a.before.resolve(), None), **setups}
    found: dict[str, dict[str, list[float]]] = {s: {} for s in setups}
    consume = ["consume", "--systems", "none", "--reps", "1", "--n", str(a.n)]
    publish = ["publish", "--payload", "i", "--single", "1000", "--reps", "1"]
    for r in range(a.rounds):
        order = list(setups) if r % 2 == 0 else list(reversed(setups))
        for name in order:
            tree, site = setups[name]
            c = run(tree, site, consume, tmp / "c.json")["consume"]["raw"]
            [rep] = next(iter(c.values()))
            got = rep["consume"]
            p = run(tree, site, publish, tmp / "p.json")["publish"]["raw"]["i"][0]
            rows = {
                "consume msgs/s": a.n / got["consume_s"],
                "consumer CPU µs/msg": 1e6
                * (got["consume_client_cpu_s"] + got["consume_client_sys_s"])
                / a.n,
                "publish_many msgs/s": p["msgs_s"],
                "publish() p50 ms": p["single_p50_ms"],
                "publish() CPU µs/call": p["single_cpu_us"],
            }
            for key, value in rows.items():
                found[name].setdefault(key, []).append(value)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows.items()))
    keys = list(found["off"])
    print("\n| set-up | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name in setups:
        cells = []
        for key in keys:
            median = statistics.median(found[name][key])
            ratio = median / statistics.median(found["off"][key])
            cells.append(f"{median:,.3g} ({ratio:.3f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nmedians of {a.rounds} interleaved rounds; (ratio to `off`)")
    if a.dsn:
        publish_in_span(a.dsn, 2 * a.rounds)


if __name__ == "__main__":
    main()
