"""A member's numbers through OpenTelemetry (`pgq.otel.metrics`), read with the
SDK's in-memory metric reader: the same numbers the Prometheus collector serves."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import FAST, wait_until

import pgq

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from pgq.otel.metrics import instrument_metrics


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], float]]]:
    """Every metric collected now: name -> [(attributes, value)]."""
    data = reader.get_metrics_data()
    found: dict[str, list[tuple[dict[str, Any], float]]] = {}
    if data is None:
        return found
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "pgq"
            for metric in scope.metrics:
                found[metric.name] = [
                    (dict(p.attributes or {}), p.value) for p in metric.data.data_points
                ]
    return found


def test_member_counts_breakers_and_group_numbers(engine):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    pgq.publish(engine, "t", {"poison": True})

    def handler(msg: pgq.Message) -> None:
        if msg.payload.get("poison"):
            raise pgq.PermanentError("bad")

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    consumer = pgq.Consumer(engine, "g", handler, workers=2, name="m1", **FAST)
    instrument_metrics(consumer, provider)
    assert points(reader) == {}  # not started: no member numbers, no group numbers yet
    try:
        with consumer:

            def drained() -> dict[str, Any] | None:  # the member's next read of its numbers
                found = points(reader)
                lag = found.get("pgq.group.lag")
                return found if lag and lag[0][1] == 0 else None

            found = wait_until(drained, 20, "the metrics to report no lag")
    finally:
        provider.shutdown()
    mine = {"messaging.consumer.group.name": "g", "messaging.client.id": "m1"}
    group = {"messaging.consumer.group.name": "g", "messaging.destination.name": "t"}
    assert found["pgq.done"] == [(mine, 10)]
    assert found["pgq.dead"] == [(mine, 1)]
    assert found["pgq.handled"] == [(mine, 11)]
    assert found["pgq.local_breaker.open"] == [(mine, 0)]
    assert found["pgq.group_breaker.open"] == [(mine, 0)]
    assert found["pgq.in_flight"] == [(mine, 0)]
    assert found["pgq.group.dead_rows"] == [(group, 1)]
    assert found["pgq.group.done"] == [(group, 10)]
    assert found["pgq.group.live_members"] == [(group, 1)]
