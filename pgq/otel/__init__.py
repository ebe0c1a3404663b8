"""OpenTelemetry, the `otel` extra (decision 0043): the only package that imports
`opentelemetry`, and only when it is installed.

- `pgq.otel.tracing`: trace context in message headers, a PRODUCER span per
  publish inside a span, a CONSUMER span per handler call, breaker transitions
  as span events. pgq uses it by itself; nothing to call.
- `pgq.otel.metrics`: `instrument_metrics(consumer)`, a member's numbers as
  observable OpenTelemetry instruments.

Nothing is imported here, so that importing one does not import the other.
"""
