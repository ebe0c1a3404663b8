"""Processes for the OpenTelemetry tests (`tests/integration/test_otel_traces.py`): each
sets up the SDK with an in-memory exporter, does its part against a real
database and writes its finished spans to a JSON file.

    python tests/otel_processes.py produce DSN SCHEMA OUT
        inside a span `request`: publish {"ok": 1} and {"fail": 1} to `orders`
        (one call each), then a batch of two with `publish_many`
    python tests/otel_processes.py consume DSN SCHEMA OUT
        drain group `billing` (a plain handler: {"fail": ...} raises
        `PermanentError`), group `audit` (a transactional batch handler) and
        group `ledger` (a transactional handler)
    python tests/otel_processes.py outage DSN SCHEMA OUT
        drain group `billing` with a handler that fails systemically while
        `outage.flag` beside OUT exists: the breakers trip, then close
    python tests/otel_processes.py untraced DSN SCHEMA OUT
        with `opentelemetry` made unimportable: publish and drain `billing`,
        then write which `opentelemetry` modules were imported (none)
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _plain(attributes: Any) -> dict[str, Any]:
    return {
        k: v if isinstance(v, str | int | float | bool) else list(v)
        for k, v in (attributes or {}).items()
    }


def _spans_json(spans: Any) -> list[dict[str, Any]]:
    """The finished spans as JSON: names, kinds, ids, attributes, links, events, status."""

    def ctx(c: Any) -> dict[str, str]:
        return {"trace_id": format(c.trace_id, "032x"), "span_id": format(c.span_id, "016x")}

    return [
        {
            "name": s.name,
            "kind": s.kind.name,
            **ctx(s.context),
            "parent_span_id": None if s.parent is None else format(s.parent.span_id, "016x"),
            "attributes": _plain(s.attributes),
            "links": [{**ctx(k.context), "attributes": _plain(k.attributes)} for k in s.links],
            "events": [{"name": e.name, "attributes": _plain(e.attributes)} for e in s.events],
            "status": s.status.status_code.name,
            "description": s.status.description,
        }
        for s in spans
    ]


def _sdk() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def produce(dsn: str, schema: str, out: Path) -> None:
    from opentelemetry import trace

    import pgq

    exporter = _sdk()
    engine = pgq.connect(dsn, schema=schema)
    with trace.get_tracer("tests").start_as_current_span("request"):
        pgq.publish(engine, "orders", {"ok": 1}, headers={"tenant": "a"})
        pgq.publish(engine, "orders", {"fail": 1})
        pgq.publish_many(engine, "orders", [{"ok": 2}, {"ok": 3}])
    out.write_text(json.dumps(_spans_json(exporter.get_finished_spans())))


def consume(dsn: str, schema: str, out: Path) -> None:
    from helpers import FAST

    import pgq

    exporter = _sdk()
    engine = pgq.connect(dsn, schema=schema)

    def handler(msg: pgq.Message) -> None:
        if "fail" in msg.payload:
            raise pgq.PermanentError("refused by the handler")

    def batch(msgs: list[pgq.Message], conn: Any) -> None:
        pass

    pgq.Consumer(engine, "billing", handler, **FAST).run(until_empty=True)
    pgq.Consumer(
        engine, "audit", batch_handler=batch, transactional=True, batch_size=10, **FAST
    ).run(until_empty=True)
    pgq.Consumer(engine, "ledger", lambda msg, conn: None, transactional=True, **FAST).run(
        until_empty=True
    )
    out.write_text(json.dumps(_spans_json(exporter.get_finished_spans())))


def outage(dsn: str, schema: str, out: Path) -> None:
    from helpers import LONE_OUTAGE

    import pgq

    exporter = _sdk()
    engine = pgq.connect(dsn, schema=schema)
    flag = out.with_name("outage.flag")
    calls = 0
    lock = threading.Lock()

    def handler(msg: pgq.Message) -> None:
        nonlocal calls
        with lock:
            calls += 1
            if calls == 6:  # the dependency comes back once the breakers tripped
                flag.unlink()
        if flag.exists():
            raise ConnectionError("the dependency is down")

    consumer = pgq.Consumer(engine, "billing", handler, **LONE_OUTAGE)
    consumer.start()
    deadline = time.monotonic() + 30
    while consumer.snapshot().done < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    consumer.stop()
    out.write_text(json.dumps(_spans_json(exporter.get_finished_spans())))


class _Blocker:
    """Makes `opentelemetry` unimportable, as when the extra is not installed."""

    def find_spec(self, name: str, *args: object) -> None:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")


def untraced(dsn: str, schema: str, out: Path) -> None:
    sys.meta_path.insert(0, _Blocker())
    from helpers import FAST

    import pgq

    engine = pgq.connect(dsn, schema=schema)
    pgq.publish(engine, "orders", {"ok": 1})
    pgq.publish_many(engine, "orders", [{"ok": 2}])
    seen: list[Any] = []
    summary = pgq.Consumer(engine, "billing", lambda m: seen.append(m.headers), **FAST).run(
        until_empty=True
    )
    from pgq.otel import tracing

    out.write_text(
        json.dumps(
            {
                "done": summary.done,
                "headers": seen,
                "tracing": tracing.TRACING,
                "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
            }
        )
    )


if __name__ == "__main__":
    mode, dsn, schema, out = sys.argv[1:5]
    {"produce": produce, "consume": consume, "outage": outage, "untraced": untraced}[mode](
        dsn, schema, Path(out)
    )
