"""Trace context (the `otel` extra): carried in message headers, spans around
publishing and around each handler call, breaker transitions as span events
(decision 0043).

Without `opentelemetry` installed, `TRACING`
is False, the publish path never calls in here and a member's `tracing` is None
(one attribute read per message on the hot path); nothing is imported.

- `publish_traced`: `publish`/`publish_many` inside a valid span record a
  PRODUCER span `send <topic>` and write its W3C `traceparent`/`tracestate`
  (the global propagator's fields) into the message headers, unless the caller's
  headers already carry a `traceparent`. With no span active nothing changes.
- `consumer_tracing`: what a member uses to run each handler call in a CONSUMER
  span `process <topic>`, parented on the message's context (a batch handler's
  one span links to each message's), with the messaging semantic conventions'
  attributes and the outcome. None when no tracer provider is set: a member
  then adds nothing per message (set the provider before `Consumer.start()`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pgq.logcontext import get_logger
from pgq.records import Claimed, Outcome, OutcomeKind

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider


try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError:  # the `otel` extra is not installed
    TRACING = False
else:
    TRACING = True

logger = get_logger(__name__)

__all__ = [
    "TRACING",
    "ConsumerTracing",
    "consumer_tracing",
    "publish_traced",
]

SYSTEM = "pgq"
"""`messaging.system`."""

INSTRUMENTATION = "pgq"
"""The tracer's and the meter's instrumentation scope name."""

TRACEPARENT = "traceparent"

# attributes: the messaging semantic conventions' names, and pgq's own under
# `messaging.pgq.*` (as `messaging.kafka.*` are Kafka's)
A_SYSTEM = "messaging.system"
A_DESTINATION = "messaging.destination.name"
A_GROUP = "messaging.consumer.group.name"
A_MESSAGE_ID = "messaging.message.id"
A_OPERATION = "messaging.operation.type"
A_OPERATION_NAME = "messaging.operation.name"
A_COUNT = "messaging.batch.message_count"
A_CLIENT = "messaging.client.id"
A_KEY = "messaging.pgq.message.key"
A_ATTEMPT = "messaging.pgq.attempt"
A_OUTCOME = "messaging.pgq.outcome"
A_ERROR_CLASS = "messaging.pgq.error_class"
A_PROBE = "messaging.pgq.probe"
A_MESSAGE_IDS = "messaging.pgq.message_ids"
A_OUTCOMES = "messaging.pgq.outcomes"

REFUSED = "refused"
"""Outcome word: the lease was lost, nothing was written (another member runs it)."""
RELEASED = "released"
"""Outcome word: the row went back to ready unstarted (a transaction rolled back
without a failure of its own)."""
TIMEOUT = "timeout"
"""Outcome word: the watchdog abandoned the call (`handler_timeout`); the attempt's
retry or death is written without waiting for it."""

Result = Outcome | Sequence[tuple[Outcome, str]] | None
"""What a traced handler call ended in: one outcome (its kind is the word), each
row's outcome with its word, or None (abandoned: `TIMEOUT`)."""


# --- publishing ------------------------------------------------------------------


def publish_traced(
    topic: str,
    count: int,
    headers: Mapping[str, Any] | None,
    publish: Callable[[Mapping[str, Any] | None], list[int]],
) -> list[int]:
    """`publish(headers)`, in a PRODUCER span when a span is active here, its context
    added to `headers`; else `publish(headers)` alone."""
    if not trace.get_current_span().get_span_context().is_valid:
        return publish(headers)
    attributes: dict[str, Any] = {
        A_SYSTEM: SYSTEM,
        A_DESTINATION: topic,
        A_OPERATION: "send",
        A_OPERATION_NAME: "send",
    }
    if count != 1:
        attributes[A_COUNT] = count
    span = _tracer().start_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes)
    with trace.use_span(span, end_on_exit=True):
        ids = publish(inject(span, headers))
        if len(ids) == 1:
            span.set_attribute(A_MESSAGE_ID, str(ids[0]))
        return ids


def inject(span: Span, headers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`headers` with `span`'s context added (`traceparent`, `tracestate`: what the
    global propagator writes); `headers` as they are when they carry a
    `traceparent` already (the caller's choice wins)."""
    carrier: dict[str, Any] = {} if headers is None else dict(headers)
    if TRACEPARENT in carrier:
        return None if headers is None else carrier
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier or None


def extract(headers: object) -> Any:
    """The context a message's headers carry, or None. Stored headers are any JSON
    (decision 0036): only an object's text values are read, and what a propagator
    cannot read is no context; never raises."""
    if not isinstance(headers, dict) or TRACEPARENT not in headers:
        return None
    carrier = {k: v for k, v in headers.items() if isinstance(v, str)}
    try:
        return propagate.extract(carrier)
    except Exception:  # a custom propagator's error must not fail the message
        return None


# --- consuming -------------------------------------------------------------------


def consumer_tracing(
    topic: str, group: str, member: str, provider: TracerProvider | None = None
) -> ConsumerTracing | None:
    """What a member traces its handler calls with; None without the extra or when
    no tracer provider is set (the API's default: spans would record nothing)."""
    if not TRACING:
        return None
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
    return ConsumerTracing(provider.get_tracer(INSTRUMENTATION), topic, group, member)


class ConsumerTracing:
    """Starts a member's CONSUMER spans and its breaker events."""

    def __init__(self, tracer: Tracer, topic: str, group: str, member: str) -> None:
        self.tracer = tracer
        self.topic = topic
        self.group = group
        self.name = f"process {topic}"
        self.common: dict[str, Any] = {
            A_SYSTEM: SYSTEM,
            A_DESTINATION: topic,
            A_GROUP: group,
            A_OPERATION: "process",
            A_OPERATION_NAME: "process",
            A_CLIENT: member,
        }

    @contextlib.contextmanager
    def processing(self, rows: Sequence[Claimed]) -> Iterator[Processing]:
        """A CONSUMER span, current while the block runs (the handler's own spans are
        its children): one row's is parented on its message's context, several rows'
        (a batch handler) link to each message's. Exceptions escaping the block
        (pgq's own, not the handler's) mark it failed."""
        attributes = dict(self.common)
        links: list[Link] = []
        parent = None
        if len(rows) == 1:
            row = rows[0]
            message = row.message
            parent = extract(message.headers)
            attributes[A_MESSAGE_ID] = str(row.id)
            attributes[A_ATTEMPT] = message.attempt
            if message.key is not None:
                attributes[A_KEY] = message.key
        else:
            attributes[A_COUNT] = len(rows)
            attributes[A_MESSAGE_IDS] = [str(row.id) for row in rows]
            for row in rows:
                context = extract(row.message.headers)
                if context is not None:
                    linked = trace.get_current_span(context).get_span_context()
                    if linked.is_valid:
                        links.append(Link(linked, {A_MESSAGE_ID: str(row.id)}))
        if any(row.probe for row in rows):
            attributes[A_PROBE] = True
        with self.tracer.start_as_current_span(
            self.name,
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
        ) as span:
            yield Processing(span)

    def breaker_event(self, name: str, attributes: Mapping[str, Any]) -> None:
        """A breaker transition the member saw: an event on the current span when one
        records (the handler call whose outcome tripped it), else on a short span of
        its own, `pgq breaker <group>`."""
        attrs = {A_GROUP: self.group, A_DESTINATION: self.topic, **attributes}
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(name, attrs)
            return
        with self.tracer.start_as_current_span(
            f"pgq breaker {self.group}", attributes={A_SYSTEM: SYSTEM, **self.common}
        ) as own:
            own.add_event(name, attrs)


class Processing:
    """One CONSUMER span while its handler call runs; `finished` records the outcome."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def finished(self, result: Result) -> None:
        """Record what the call ended in: the outcome (`messaging.pgq.outcome`, or a
        batch's `messaging.pgq.outcomes` in row order) and an error status when an
        attempt failed or was abandoned."""
        span = self.span
        if result is None:
            span.set_attribute(A_OUTCOME, TIMEOUT)
            span.set_status(Status(StatusCode.ERROR, "handler ran past handler_timeout"))
            return
        pairs = [(result, str(result.kind))] if isinstance(result, Outcome) else list(result)
        words = [word for _, word in pairs]
        if len(pairs) == 1:
            span.set_attribute(A_OUTCOME, words[0])
        else:
            span.set_attribute(A_OUTCOMES, words)
        failed = [o for o, _ in pairs if o.kind in (OutcomeKind.RETRY, OutcomeKind.DEAD)]
        if failed:
            first = failed[0]
            if first.error_class is not None:
                span.set_attribute(A_ERROR_CLASS, str(first.error_class))
            span.set_status(Status(StatusCode.ERROR, first.error or ""))


def record_exception(exc: BaseException) -> None:
    """The handler's exception as an event of the current span (when one records).
    Never raises: an exception that cannot be formatted (its attribute reads raise,
    decision 0036) is left out; the outcome's error says what is known of it."""
    span = trace.get_current_span()
    if span.is_recording():
        try:
            span.record_exception(exc)
        except Exception:
            logger.debug("exception not recorded on the span: it cannot be formatted")


_TRACERS: list[Tracer] = []


def _tracer() -> Tracer:
    """The publish side's tracer, got once: a proxy until a provider is set, which
    then delegates to it (`trace.get_tracer` per call cost 8 µs of a span's 35)."""
    if not _TRACERS:
        _TRACERS.append(trace.get_tracer(INSTRUMENTATION))
    return _TRACERS[0]
