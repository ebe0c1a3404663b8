"""Trace context across a real process boundary (DESIGN §7, decision 0043).

A producer process publishes inside a span, a consumer process drains the group;
each writes the spans its SDK finished (an in-memory exporter) to a JSON file
(`tests/otel_processes.py`). One trace: the CONSUMER spans' trace id is the
PRODUCER span's, each parented on (a batch: linked to) it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

import pgq

pytest.importorskip("opentelemetry.sdk")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "otel_processes.py"


@pytest.fixture
def orders_groups() -> tuple[str, ...]:
    return ("billing", "audit", "ledger")


def run(mode: str, pg_dsn: str, schema: str, out: Path) -> Any:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, pg_dsn, schema, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def by_name(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


def test_publish_in_one_process_and_consume_in_another_is_one_trace(
    orders: Engine, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    produced = run("produce", pg_dsn, schema, tmp_path / "produced.json")
    [request] = by_name(produced, "request")
    sends = by_name(produced, "send orders")
    assert len(sends) == 3
    for send in sends:
        assert send["kind"] == "PRODUCER"
        assert send["trace_id"] == request["trace_id"]
        assert send["parent_span_id"] == request["span_id"]
        assert send["attributes"]["messaging.system"] == "pgq"
        assert send["attributes"]["messaging.destination.name"] == "orders"
    ok_send, fail_send, batch_send = sends
    assert batch_send["attributes"]["messaging.batch.message_count"] == 2
    assert "messaging.message.id" not in batch_send["attributes"]

    # the headers carry the PRODUCER span's context; the caller's own header stays
    with orders.connect() as conn:
        stored = dict(
            conn.exec_driver_sql(
                f'SELECT id, headers FROM "{schema}".message ORDER BY id'
            ).fetchall()
        )
    ids = sorted(stored)
    assert [str(i) for i in ids[:2]] == [
        ok_send["attributes"]["messaging.message.id"],
        fail_send["attributes"]["messaging.message.id"],
    ]
    assert stored[ids[0]]["tenant"] == "a"
    for mid, send in zip(ids, [ok_send, fail_send, batch_send, batch_send], strict=True):
        trace_id, span_id = stored[mid]["traceparent"].split("-")[1:3]
        assert (trace_id, span_id) == (send["trace_id"], send["span_id"])

    consumed = run("consume", pg_dsn, schema, tmp_path / "consumed.json")
    process = by_name(consumed, "process orders")
    billing = {
        s["attributes"]["messaging.message.id"]: s
        for s in process
        if s["attributes"]["messaging.consumer.group.name"] == "billing"
    }
    assert sorted(billing) == sorted(str(i) for i in ids)
    for mid, send in zip(ids, [ok_send, fail_send, batch_send, batch_send], strict=True):
        span = billing[str(mid)]
        assert span["kind"] == "CONSUMER"
        assert span["trace_id"] == request["trace_id"]  # one trace across the processes
        assert span["parent_span_id"] == send["span_id"]
        attributes = span["attributes"]
        assert attributes["messaging.system"] == "pgq"
        assert attributes["messaging.destination.name"] == "orders"
        assert attributes["messaging.pgq.attempt"] == 1
        assert attributes["messaging.operation.type"] == "process"
    done, dead = billing[str(ids[0])], billing[str(ids[1])]
    assert done["attributes"]["messaging.pgq.outcome"] == "done"
    assert done["status"] == "UNSET"
    assert dead["attributes"]["messaging.pgq.outcome"] == "dead"
    assert dead["attributes"]["messaging.pgq.error_class"] == "permanent"
    assert dead["status"] == "ERROR"
    assert "refused by the handler" in dead["description"]
    assert [e["name"] for e in dead["events"]] == ["exception"]

    # the transactional batch handler: one span per batch, linked to each message
    [batch] = [s for s in process if s["attributes"]["messaging.consumer.group.name"] == "audit"]
    assert batch["kind"] == "CONSUMER"
    assert batch["attributes"]["messaging.batch.message_count"] == 4
    assert batch["attributes"]["messaging.pgq.message_ids"] == [str(i) for i in ids]
    assert batch["attributes"]["messaging.pgq.outcomes"] == ["done"] * 4
    links = {(link["trace_id"], link["span_id"]) for link in batch["links"]}
    assert links == {(s["trace_id"], s["span_id"]) for s in sends}

    # a transactional handler: a span per message, done once its transaction committed
    ledger = [s for s in process if s["attributes"]["messaging.consumer.group.name"] == "ledger"]
    assert sorted(s["attributes"]["messaging.message.id"] for s in ledger) == sorted(billing)
    for span in ledger:
        assert span["trace_id"] == request["trace_id"]
        assert span["attributes"]["messaging.pgq.outcome"] == "done"


def test_breaker_transitions_are_span_events(
    orders: Engine, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    pgq.publish_many(orders, "orders", [{"n": n} for n in range(20)])
    (tmp_path / "outage.flag").touch()
    spans = run("outage", pg_dsn, schema, tmp_path / "spans.json")
    events = {
        e["name"]: s for s in spans for e in s["events"] if e["name"].startswith("pgq.breaker.")
    }
    # the local trip happens while the failing call's CONSUMER span is current
    tripped = events["pgq.breaker.local_open"]
    assert tripped["name"] == "process orders"
    assert tripped["attributes"]["messaging.pgq.outcome"] == "retry"
    # the group's transitions, seen by the heartbeat or the prober: spans of their own
    for name in ("pgq.breaker.group_open", "pgq.breaker.group_closed"):
        assert events[name]["name"] == "pgq breaker billing", name
    [event] = [e for e in events["pgq.breaker.group_open"]["events"]]
    assert event["attributes"]["messaging.consumer.group.name"] == "billing"
    assert event["attributes"]["pgq.breaker.epoch"] >= 1
    assert any(s["attributes"].get("messaging.pgq.probe") for s in by_name(spans, "process orders"))
    assert all(
        s["attributes"].get("messaging.pgq.outcome") in ("done", "retry", "snooze")
        for s in by_name(spans, "process orders")
    )


def test_without_opentelemetry_nothing_is_imported_and_nothing_changes(
    orders: Engine, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    seen = run("untraced", pg_dsn, schema, tmp_path / "untraced.json")
    assert seen == {"done": 2, "headers": [None, None], "tracing": False, "imported": []}
