"""Trace context helpers (`pgq.otel.tracing`) with the SDK's in-memory exporter:
injection and extraction, the PRODUCER and CONSUMER spans, outcomes, breaker
events. No database; no global tracer provider is set (each test has its own)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import FakeClock

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pgq.consumer.gate import Gate
from pgq.otel import tracing
from pgq.records import Claimed, Lease, Message, Outcome, OutcomeKind
from pgq.settings import Settings


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    yield p
    p.shutdown()


@pytest.fixture
def traced(provider: TracerProvider, monkeypatch: pytest.MonkeyPatch) -> trace.Tracer:
    """The tracer `publish_traced` uses, of this test's provider."""
    tracer = provider.get_tracer("tests")
    monkeypatch.setattr(tracing, "_tracer", lambda: tracer)
    return tracer


NOW = dt.datetime.now(dt.timezone.utc)


def traceparent(span: Any) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def row(mid: int = 1, headers: dict[str, Any] | None = None, **kw: Any) -> Claimed:
    msg = Message(mid, "orders", "billing", "k", {}, headers, 2, dt.datetime.now(dt.timezone.utc))
    return Claimed(msg, Lease(mid, 1), attempts=1, **kw)


def test_inject_writes_the_span_context_beside_the_callers_headers(provider):
    span = provider.get_tracer("t").start_span("send")
    given = {"tenant": "a"}
    headers = tracing.inject(span, given)
    assert headers == {"tenant": "a", "traceparent": traceparent(span)}
    assert given == {"tenant": "a"}  # the caller's mapping is not changed
    assert tracing.inject(span, None) == {"traceparent": traceparent(span)}


def test_inject_keeps_a_traceparent_the_caller_wrote(provider):
    span = provider.get_tracer("t").start_span("send")
    theirs = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "x": 1}
    assert tracing.inject(span, theirs) == theirs


def test_inject_writes_tracestate(provider):
    tracer = provider.get_tracer("t")
    state = trace.TraceState([("vendor", "v1")])
    parent = trace.NonRecordingSpan(
        trace.SpanContext(
            0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(1), trace_state=state
        )
    )
    span = tracer.start_span("send", context=trace.set_span_in_context(parent))
    assert tracing.inject(span, None)["tracestate"] == "vendor=v1"


def test_extract_reads_back_what_inject_wrote(provider):
    span = provider.get_tracer("t").start_span("send")
    headers = tracing.inject(span, {"n": 5})
    context = tracing.extract(headers)
    found = trace.get_current_span(context).get_span_context()
    assert (found.trace_id, found.span_id) == (
        span.get_span_context().trace_id,
        span.get_span_context().span_id,
    )
    assert found.is_remote
    assert tracing.extract(None) is None
    assert tracing.extract({"n": 5}) is None
    bad = tracing.extract({"traceparent": 17})  # not text: ignored
    assert not trace.get_current_span(bad).get_span_context().is_valid


def test_publish_without_an_active_span_changes_nothing(traced, exporter):
    given = {"tenant": "a"}
    seen: list[Any] = []
    assert tracing.publish_traced("orders", 1, given, lambda h: seen.append(h) or [7]) == [7]
    assert seen == [given] and seen[0] is given
    assert exporter.get_finished_spans() == ()


def test_publish_in_a_span_records_a_producer_span_and_injects_it(traced, exporter):
    seen: list[Any] = []
    with traced.start_as_current_span("request") as request:
        tracing.publish_traced("orders", 1, None, lambda h: seen.append(h) or [7])
        tracing.publish_traced("orders", 3, {"a": 1}, lambda h: seen.append(h) or [8, 9, 10])
    one, many, _ = exporter.get_finished_spans()
    for span in (one, many):
        assert span.name == "send orders"
        assert span.kind == SpanKind.PRODUCER
        assert span.parent.span_id == request.get_span_context().span_id
        assert span.attributes["messaging.system"] == "pgq"
        assert span.attributes["messaging.destination.name"] == "orders"
        assert span.attributes["messaging.operation.type"] == "send"
    assert one.attributes["messaging.message.id"] == "7"
    assert many.attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in many.attributes
    assert seen[0] == {"traceparent": traceparent(one)}
    assert seen[1] == {"a": 1, "traceparent": traceparent(many)}


def test_a_failed_publish_marks_its_span_failed(traced, exporter):
    def refuse(_: Any) -> list[int]:
        raise RuntimeError("no such topic")

    with traced.start_as_current_span("request"), pytest.raises(RuntimeError):
        tracing.publish_traced("orders", 1, None, refuse)
    send = exporter.get_finished_spans()[0]
    assert send.status.status_code == StatusCode.ERROR
    assert [e.name for e in send.events] == ["exception"]


def test_without_a_tracer_provider_a_member_traces_nothing(provider):
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # none set
    assert tracing.consumer_tracing("orders", "billing", "m") is None
    assert tracing.consumer_tracing("orders", "billing", "m", provider) is not None


def consumer(provider: TracerProvider) -> tracing.ConsumerTracing:
    made = tracing.consumer_tracing("orders", "billing", "host:1:ab", provider)
    assert made is not None
    return made


def test_a_handler_call_is_a_consumer_span_parented_on_its_message(provider, exporter):
    producer = provider.get_tracer("t").start_span("send orders")
    r = row(5, tracing.inject(producer, None))
    with consumer(provider).processing([r]) as span:
        inner = trace.get_current_span()  # the handler's spans are its children
        span.finished(Outcome(r, OutcomeKind.DONE))
    [process] = exporter.get_finished_spans()
    assert inner.get_span_context().span_id == process.context.span_id
    assert process.name == "process orders"
    assert process.kind == SpanKind.CONSUMER
    assert process.context.trace_id == producer.get_span_context().trace_id
    assert process.parent.span_id == producer.get_span_context().span_id
    assert dict(process.attributes) == {
        "messaging.system": "pgq",
        "messaging.destination.name": "orders",
        "messaging.consumer.group.name": "billing",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.client.id": "host:1:ab",
        "messaging.message.id": "5",
        "messaging.pgq.attempt": 2,
        "messaging.pgq.message.key": "k",
        "messaging.pgq.outcome": "done",
    }
    assert process.status.status_code == StatusCode.UNSET


def test_a_message_without_context_starts_a_trace(provider, exporter):
    with consumer(provider).processing([row(1, {"other": "x"})]) as span:
        span.finished(Outcome(row(1), OutcomeKind.SNOOZE, delay=1.0))
    [process] = exporter.get_finished_spans()
    assert process.parent is None
    assert process.attributes["messaging.pgq.outcome"] == "snooze"
    assert process.status.status_code == StatusCode.UNSET


@pytest.mark.parametrize("kind", [OutcomeKind.RETRY, OutcomeKind.DEAD])
def test_a_failed_attempt_has_its_outcome_and_an_error_status(provider, exporter, kind):
    r = row(1, probe=True)
    with consumer(provider).processing([r]) as span:
        span.finished(Outcome(r, kind, error_class="systemic", error="ConnectionError: down"))
    [process] = exporter.get_finished_spans()
    assert process.attributes["messaging.pgq.outcome"] == str(kind)
    assert process.attributes["messaging.pgq.error_class"] == "systemic"
    assert process.attributes["messaging.pgq.probe"] is True
    assert process.status.status_code == StatusCode.ERROR
    assert process.status.description == "ConnectionError: down"


def test_an_abandoned_call_is_a_timeout(provider, exporter):
    with consumer(provider).processing([row(1)]) as span:
        span.finished(None)
    [process] = exporter.get_finished_spans()
    assert process.attributes["messaging.pgq.outcome"] == "timeout"
    assert process.status.status_code == StatusCode.ERROR


def test_a_batch_is_one_span_linked_to_each_message(provider, exporter):
    tracer = provider.get_tracer("t")
    sends = [tracer.start_span("send orders") for _ in range(2)]
    rows = [row(1, tracing.inject(sends[0], None)), row(2), row(3, tracing.inject(sends[1], None))]
    with consumer(provider).processing(rows) as span:
        span.finished(
            [
                (Outcome(rows[0], OutcomeKind.DONE), "done"),
                (Outcome(rows[1], OutcomeKind.DONE), tracing.RELEASED),
                (Outcome(rows[2], OutcomeKind.DONE), tracing.REFUSED),
            ]
        )
    [process] = exporter.get_finished_spans()
    assert process.parent is None
    assert process.attributes["messaging.batch.message_count"] == 3
    assert list(process.attributes["messaging.pgq.message_ids"]) == ["1", "2", "3"]
    assert list(process.attributes["messaging.pgq.outcomes"]) == ["done", "released", "refused"]
    assert "messaging.message.id" not in process.attributes
    assert [
        (link.context.span_id, link.attributes["messaging.message.id"]) for link in process.links
    ] == [
        (sends[0].get_span_context().span_id, "1"),
        (sends[1].get_span_context().span_id, "3"),
    ]


def test_breaker_events_go_on_the_current_span_or_a_span_of_their_own(provider, exporter):
    c = consumer(provider)
    r = row(1)
    with c.processing([r]) as span:
        c.breaker_event("pgq.breaker.local_open", {"pgq.breaker.epoch": 0})
        span.finished(Outcome(r, OutcomeKind.RETRY, error_class="systemic", error="x"))
    c.breaker_event("pgq.breaker.group_open", {"pgq.breaker.epoch": 3, "pgq.breaker.by": "quorum"})
    process, own = exporter.get_finished_spans()
    assert [e.name for e in process.events] == ["pgq.breaker.local_open"]
    assert own.name == "pgq breaker billing"
    [event] = own.events
    assert event.name == "pgq.breaker.group_open"
    assert dict(event.attributes) == {
        "messaging.consumer.group.name": "billing",
        "messaging.destination.name": "orders",
        "pgq.breaker.epoch": 3,
        "pgq.breaker.by": "quorum",
    }


def test_the_gate_tells_each_transition_once():
    clock = FakeClock()
    gate = Gate(Settings(breaker_window=4, breaker_min_calls=2, breaker_open_for=1.0), clock)
    events: list[tuple[str, dict[str, object]]] = []
    gate.events = lambda name, attrs: events.append((name, attrs))
    gate.see_group("CLOSED", 0)
    for i in range(3):
        gate.observe(Outcome(row(i), OutcomeKind.RETRY, error_class="systemic", error="x"))
    gate.see_group("OPEN", 1, by="quorum")
    gate.see_group("OPEN", 1)
    gate.see_group("CLOSED", 2, by="probe")
    assert gate.claim_mode() == "probe"  # the close does not heal the member: it probes
    gate.observe(Outcome(row(9, probe=True), OutcomeKind.RETRY, error_class="systemic"))
    clock.advance(10)
    assert gate.claim_mode() == "probe"
    gate.observe(Outcome(row(10, probe=True), OutcomeKind.DONE))
    assert events == [
        ("pgq.breaker.local_open", {"pgq.breaker.epoch": 0, "pgq.breaker.trips": 1}),
        ("pgq.breaker.group_open", {"pgq.breaker.epoch": 1, "pgq.breaker.by": "quorum"}),
        ("pgq.breaker.group_closed", {"pgq.breaker.epoch": 2, "pgq.breaker.by": "probe"}),
        ("pgq.breaker.local_probe_failed", {"pgq.breaker.epoch": 2}),
        ("pgq.breaker.local_closed", {"pgq.breaker.epoch": 2}),
    ]


@pytest.mark.parametrize(
    "headers",
    [
        "traceparent",  # JSON headers that are no object (decision 0036: hostile input)
        ["traceparent"],
        {"traceparent": "not a traceparent", "tracestate": "=,="},
        {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"},  # all-zero ids: invalid
    ],
)
def test_hostile_headers_give_a_root_span_and_never_raise(provider, exporter, headers):
    r = row(1)._replace(message=Message(1, "orders", "billing", None, {}, headers, 1, NOW))
    with consumer(provider).processing([r, row(2, headers)]) as span:
        span.finished(None)
    with consumer(provider).processing([r]) as span:
        span.finished(Outcome(r, OutcomeKind.DONE))
    batch, single = exporter.get_finished_spans()
    assert single.parent is None and batch.links == ()


class _Unreadable(Exception):
    """Reading any attribute it lacks raises KeyError (an RPC error forwarding to its
    payload): `traceback` cannot format it (decision 0036)."""

    def __getattr__(self, name: str) -> object:
        raise KeyError(name)


def test_an_exception_that_cannot_be_formatted_is_not_recorded_and_does_not_raise(
    provider, exporter
):
    r = row(1)
    with consumer(provider).processing([r]) as span:
        tracing.record_exception(_Unreadable("no"))  # Handling.failure calls this
        tracing.record_exception(ValueError("readable"))
        span.finished(Outcome(r, OutcomeKind.DEAD, error_class="message", error="x"))
    [process] = exporter.get_finished_spans()
    assert [e.attributes["exception.type"] for e in process.events] == ["ValueError"]
