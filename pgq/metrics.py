"""Prometheus metrics for a running member (`pgq consume --metrics-port`).

Needs the `metrics` extra (prometheus-client). Values are read from the
consumer when Prometheus scrapes, so nothing is added to the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pgq.errors import ConfigError

if TYPE_CHECKING:
    from pgq.consumer import Consumer


class ConsumerCollector:
    """Exposes a consumer's running counts and breaker states."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self.consumer.snapshot()
        labels = ["group", "member"]
        values = [self.consumer.group, self.consumer.name]
        for key in ("handled", "done", "retried", "dead", "released", "reclaimed"):
            family = CounterMetricFamily(
                f"pgq_{key}", f"messages {key} by this member", labels=labels
            )
            family.add_metric(values, float(getattr(snapshot, key)))
            yield family
        for key, value in self.consumer.breaker_states().items():
            gauge = GaugeMetricFamily(
                f"pgq_{key}_open", f"1 while the {key} is open", labels=labels
            )
            gauge.add_metric(values, 1.0 if value else 0.0)
            yield gauge


def serve_metrics(port: int, consumer: Consumer) -> None:
    """Serve `/metrics` on `port` in a daemon thread."""
    try:
        from prometheus_client import REGISTRY, start_http_server
    except ImportError:
        raise ConfigError(
            "--metrics-port needs the 'metrics' extra: pip install 'pgq-breaker[metrics]'"
        ) from None
    REGISTRY.register(ConsumerCollector(consumer))  # type: ignore[arg-type]
    start_http_server(port)
