"""Prometheus metrics for a running member (`pgq consume --metrics-port`).

Needs the `metrics` extra (prometheus-client). Values are read when Prometheus
scrapes, so nothing is added to the hot path: the member's own counts and
breaker states from memory, the group's numbers (lag, dead rows, refunds, the
`pgq check` verdict) from one status query.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pgq import monitor
from pgq.errors import ConfigError, PgqError

if TYPE_CHECKING:
    from pgq.consumer import Consumer

logger = logging.getLogger(__name__)

GROUP_GAUGES = {
    "lag": "messages of the group not yet resolved",
    "dead_rows": "dead rows of the group (systemic included)",
    "dead_systemic_rows": "dead rows whose last failure was systemic",
    "refunded_rows": "rows refunded by reconciliation since the group was created",
    "check_status": "the pgq check verdict: 0 OK, 1 WARNING, 2 CRITICAL",
}


class ConsumerCollector:
    """Exposes a consumer's running counts, its breaker states and its group's numbers."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.consumer
        snapshot = c.snapshot()
        labels, values = ["group", "member"], [c.group, c.name]
        for key in ("handled", "done", "retried", "dead", "released", "reclaimed"):
            family = CounterMetricFamily(
                f"pgq_{key}", f"messages {key} by this member", labels=labels
            )
            family.add_metric(values, float(getattr(snapshot, key)))
            yield family
        for key, is_open in c.breaker_states().items():
            gauge = GaugeMetricFamily(
                f"pgq_{key}_open", f"1 while the {key} is open", labels=labels
            )
            gauge.add_metric(values, 1.0 if is_open else 0.0)
            yield gauge
        for name, value in self._group_numbers().items():
            gauge = GaugeMetricFamily(f"pgq_group_{name}", GROUP_GAUGES[name], labels=["group"])
            gauge.add_metric([c.group], float(value))
            yield gauge

    def _group_numbers(self) -> dict[str, int]:
        c = self.consumer
        try:
            s = monitor.status(c.engine, c.group, member_ttl=c.settings.breaker_member_ttl)
            word, _ = monitor.check(c.engine, c.group, c.settings.breaker_max_refunds)
        except PgqError as exc:
            logger.warning("metrics: group numbers unavailable error=%s", exc)
            return {}
        return {
            "lag": s["lag"],
            "dead_rows": s["counts"]["dead"],
            "dead_systemic_rows": s["counts"]["dead_systemic"],
            "refunded_rows": s["totals"]["refunded"],
            "check_status": monitor.CHECK_EXIT_CODES[word],
        }


def serve_metrics(port: int, consumer: Consumer) -> None:
    """Serve `/metrics` on `port` in a daemon thread."""
    try:
        from prometheus_client import REGISTRY, start_http_server
    except ImportError:
        raise ConfigError(
            "--metrics-port needs the 'metrics' extra: pip install 'pgq-breaker[metrics]'"
        ) from None
    REGISTRY.register(ConsumerCollector(consumer))
    start_http_server(port)
