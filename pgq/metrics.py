"""Prometheus metrics for a running member (`pgq consume --metrics-port`).

Needs the `metrics` extra (prometheus-client). Values are read when Prometheus
scrapes, so nothing is added to the hot path: the member's own counts and
breaker states from memory, the group's numbers (lag, dead rows, refunds, the
`pgq check` verdict) from one status query.

The endpoint starts before the member joins its group (so it answers while a
member waits for its database): until then it serves the group's numbers
only, and the member's families appear once it has joined. The collector
describes its families without collecting, so registering it reads nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pgq import monitor
from pgq.errors import ConfigError, PgqError, install_extra

if TYPE_CHECKING:
    from pgq.consumer import Consumer

logger = logging.getLogger(__name__)

MEMBER_COUNTERS = ("handled", "done", "retried", "dead", "released", "reclaimed")
"""The member's running counts (exposed as counters `pgq_<key>_total`)."""

BREAKERS = ("local_breaker", "group_breaker")
"""The breakers as the member sees them (gauges `pgq_<name>_open`)."""

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

    def describe(self) -> Iterator[Any]:
        """The families this collector yields, without samples (read nothing)."""
        member, group = self._families()
        yield from member.values()
        yield from group.values()

    def collect(self) -> Iterator[Any]:
        c = self.consumer
        member, group = self._families()
        if c.started:
            snapshot = c.snapshot()
            labels = [c.group, c.name]
            for key in MEMBER_COUNTERS:
                member[f"pgq_{key}"].add_metric(labels, float(getattr(snapshot, key)))
            for key, is_open in c.breaker_states().items():
                member[f"pgq_{key}_open"].add_metric(labels, 1.0 if is_open else 0.0)
            yield from member.values()
        for name, value in self._group_numbers().items():
            family = group[f"pgq_group_{name}"]
            family.add_metric([c.group], float(value))
            yield family

    def _families(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Empty metric families by name: the member's and the group's."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["group", "member"]
        mine: dict[str, Any] = {
            f"pgq_{key}": CounterMetricFamily(
                f"pgq_{key}", f"messages {key} by this member", labels=labels
            )
            for key in MEMBER_COUNTERS
        }
        for key in BREAKERS:
            mine[f"pgq_{key}_open"] = GaugeMetricFamily(
                f"pgq_{key}_open", f"1 while the {key.replace('_', ' ')} is open", labels=labels
            )
        theirs = {
            f"pgq_group_{name}": GaugeMetricFamily(f"pgq_group_{name}", doc, labels=["group"])
            for name, doc in GROUP_GAUGES.items()
        }
        return mine, theirs

    def _group_numbers(self) -> dict[str, int]:
        c = self.consumer
        try:
            s = monitor.read_status(c.engine, c.group, member_ttl=c.settings.breaker_member_ttl)
            word, _ = monitor.check(c.engine, c.group, c.settings.breaker_max_refunds)
        except PgqError as exc:
            logger.warning("metrics: group numbers unavailable error=%s", exc)
            return {}
        return {
            "lag": s.lag,
            "dead_rows": s.counts.dead,
            "dead_systemic_rows": s.counts.dead_systemic,
            "refunded_rows": s.totals.refunded,
            "check_status": monitor.CHECK_EXIT_CODES[word],
        }


@contextlib.contextmanager
def serving_metrics(port: int, consumer: Consumer) -> Iterator[None]:
    """Serve `/metrics` on `port` (a daemon thread) until the block ends.

    The registry is the member's own (its collector beside the process, platform
    and garbage-collector ones), so nothing is shared with other code in the
    process. A port that cannot be bound is a `ConfigError`.
    """
    try:
        from prometheus_client import (
            GC_COLLECTOR,
            PLATFORM_COLLECTOR,
            PROCESS_COLLECTOR,
            CollectorRegistry,
            start_http_server,
        )
    except ImportError:
        raise ConfigError(
            "--metrics-port needs the 'metrics' extra: " + install_extra("metrics")
        ) from None
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    registry.register(ConsumerCollector(consumer))
    try:
        server, _ = start_http_server(port, registry=registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot serve metrics: {exc}") from None
    logger.info("serving metrics port=%d path=/metrics", port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
