"""Prometheus metrics: every group's state (`pgq web`'s `/metrics`), and a running
member's own (`pgq consume --metrics-port`).

Needs prometheus-client (the `metrics` extra; the `web` extra brings it too).
One place defines the group-level families (`GROUP_METRICS`, `group_families`),
read from the typed status (`pgq.read_models.GroupStatus`), so the dashboard
and a member expose a group under the same names and labels (`group`, `topic`);
the dashboard reads every group in one `status_all` per scrape, so a group with
no member running is still observable.

A member's scrape reads memory only and answers at once, also while the
database does not answer (decision 0031): nothing but the latency histograms
touches the hot path, and those only while metrics are served
(`Consumer.measure()`; `pgq.consumer.timing`): its counts and breaker states,
the rows it holds, the histograms, and its group's numbers (plus the `pgq
check` verdict) as the member last read them on its own `work` connection
(`pgq.consumer.numbers`, every few seconds; their age is
`pgq_group_numbers_age_seconds`, and a read older than `STALE_AFTER` is no
longer served). A scrape never opens a connection of its own.

The member's endpoint starts before the member joins its group (so it answers
while a member waits for its database): until it has joined and read its
group's numbers once, it serves the process' own families only. The
collector describes its families without collecting, so registering it reads
nothing. It listens on 127.0.0.1 unless told otherwise (`--metrics-host`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pgq import monitor
from pgq.consumer.numbers import STALE_AFTER
from pgq.consumer.timing import ACK, CLAIM, HANDLER, Merged
from pgq.errors import ConfigError, install_extra
from pgq.logcontext import get_logger, log_fields
from pgq.read_models import GroupStatus
from pgq.records import BreakerState

if TYPE_CHECKING:
    from pgq.consumer import Consumer

__all__ = [
    "GROUP_METRICS",
    "ConsumerCollector",
    "GroupMetric",
    "exposition",
    "group_families",
    "serving_metrics",
]

logger = get_logger(__name__)

DEFAULT_HOST = "127.0.0.1"
"""Where a member's endpoint listens unless `--metrics-host` says otherwise."""

GROUP_LABELS = ["group", "topic"]


@dataclass(frozen=True, slots=True)
class GroupMetric:
    """One group-level family: its name, type, help text and its value in a status
    (None: no sample for that group)."""

    name: str
    kind: Literal["gauge", "counter"]
    doc: str
    value: Callable[[GroupStatus], float | None]


GROUP_METRICS: tuple[GroupMetric, ...] = (
    GroupMetric(
        "pgq_group_ready_rows",
        "gauge",
        "rows of the group ready now (rows waiting for a retry included)",
        lambda g: g.counts.ready,
    ),
    GroupMetric(
        "pgq_group_leased_rows", "gauge", "rows of the group leased now", lambda g: g.counts.leased
    ),
    GroupMetric(
        "pgq_group_dead_rows",
        "gauge",
        "dead rows of the group (systemic included)",
        lambda g: g.counts.dead,
    ),
    GroupMetric(
        "pgq_group_dead_systemic_rows",
        "gauge",
        "dead rows whose last failure was systemic",
        lambda g: g.counts.dead_systemic,
    ),
    GroupMetric(
        "pgq_group_lag",
        "gauge",
        "messages of the group not yet resolved (ready + leased)",
        lambda g: g.lag,
    ),
    GroupMetric(
        "pgq_group_oldest_ready_age_seconds",
        "gauge",
        "how long the oldest row ready now has been claimable (no sample: none is)",
        lambda g: g.oldest_ready_age_s,
    ),
    GroupMetric(
        "pgq_group_done",
        "counter",
        "messages the group finished since it was created (pruned ones included)",
        lambda g: g.counts.done,
    ),
    GroupMetric(
        "pgq_group_reclaimed",
        "counter",
        "rows reclaimed after a lost lease since the group was created",
        lambda g: g.totals.reclaimed,
    ),
    GroupMetric(
        "pgq_group_released",
        "counter",
        "rows released unstarted (shutdown, breaker gates) since the group was created",
        lambda g: g.totals.released,
    ),
    GroupMetric(  # a gauge under its first name (decision 0031), though it only grows
        "pgq_group_refunded_rows",
        "gauge",
        "rows refunded by reconciliation since the group was created",
        lambda g: g.totals.refunded,
    ),
    GroupMetric(
        "pgq_group_breaker_epoch",
        "gauge",
        "the group breaker's epoch (grows with every transition)",
        lambda g: g.breaker.epoch,
    ),
    GroupMetric(
        "pgq_group_live_members",
        "gauge",
        "members of the group live now (heartbeat within breaker.member_ttl)",
        lambda g: g.live,
    ),
)
"""The group-level families but the breaker state (`group_families`), in output order."""


def group_families(groups: Iterable[GroupStatus]) -> list[Any]:
    """The group-level metric families of `groups`, labelled `group` and `topic`:
    `GROUP_METRICS`, then `pgq_group_breaker_state` (1 for the group breaker's
    state, 0 for the others, label `state`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    groups = list(groups)
    families: list[Any] = []
    for m in GROUP_METRICS:
        kind = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
        family = kind(m.name, m.doc, labels=GROUP_LABELS)
        for g in groups:
            value = m.value(g)
            if value is not None:
                family.add_metric([g.group, g.topic], float(value))
        families.append(family)
    state = GaugeMetricFamily(
        "pgq_group_breaker_state",
        "1 for the group breaker's state now, 0 for the others",
        labels=[*GROUP_LABELS, "state"],
    )
    for g in groups:
        for word in BreakerState:
            state.add_metric([g.group, g.topic, word.value], float(g.breaker.state is word))
    families.append(state)
    return families


class _Families:
    """Families already built, as a collector (`generate_latest` takes any)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        return iter(self.families)


def exposition(groups: Iterable[GroupStatus], accept: str = "") -> tuple[bytes, str]:
    """`groups`' families in the format the `Accept` header `accept` asks for (the
    Prometheus text format, or OpenMetrics when asked), and its content type: what
    `pgq web` answers on `/metrics`."""
    from prometheus_client.exposition import choose_encoder

    encode, content_type = choose_encoder(accept)
    return encode(_Families(group_families(groups))), content_type


# --- a running member --------------------------------------------------------------

MEMBER_COUNTERS = ("handled", "done", "retried", "dead", "released", "reclaimed")
"""The member's running counts (exposed as counters `pgq_<key>_total`)."""

BREAKERS = ("local_breaker", "group_breaker")
"""The breakers as the member sees them (gauges `pgq_<name>_open`)."""

HISTOGRAMS = {
    HANDLER: ("pgq_handler_duration_seconds", "handler runs of this member"),
    CLAIM: ("pgq_claim_duration_seconds", "claim statements of this member"),
    ACK: ("pgq_ack_duration_seconds", "outcome batches this member wrote"),
}
"""The member's latency histograms by `pgq.consumer.timing` kind: name, what is timed."""


class ConsumerCollector:
    """Exposes a consumer's running counts, breaker states, rows in flight, latency
    histograms and its group's numbers. Creating it makes the consumer time its
    work and read its group's numbers (`Consumer.measure()`): create it before
    the consumer starts."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.timings = consumer.measure()

    def describe(self) -> Iterator[Any]:
        """The families this collector yields, without samples (reads nothing)."""
        yield from self._member_families().values()
        yield self._age_family([])
        yield from group_families(())
        yield self._check_family()

    def collect(self) -> Iterator[Any]:
        """Answers from memory at once (never reads the database): the member's
        families once it has joined, and its group's numbers as the member last
        read them (`pgq.consumer.numbers`), while younger than `STALE_AFTER`."""
        c = self.consumer
        if c.started:
            yield from self._member_samples()
        numbers = c.group_numbers()
        if numbers is None:
            return
        age = max(0.0, c.clock() - numbers.taken)
        status = numbers.status
        labels = [c.group, status.topic]
        yield self._age_family([(labels, age)])
        if age > STALE_AFTER:
            return
        yield from group_families([status])
        check = self._check_family()
        check.add_metric(labels, float(monitor.CHECK_EXIT_CODES[numbers.check]))
        yield check

    def _member_families(self) -> dict[str, Any]:
        """The member's families by name, empty."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

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
        mine["pgq_in_flight_messages"] = GaugeMetricFamily(
            "pgq_in_flight_messages",
            "rows this member holds a lease on: buffered, running, or waiting for their outcome"
            " to be written",
            labels=labels,
        )
        for name, what in HISTOGRAMS.values():
            mine[name] = HistogramMetricFamily(name, f"seconds taken by {what}", labels=labels)
        return mine

    def _member_samples(self) -> Iterator[Any]:
        c = self.consumer
        mine = self._member_families()
        snapshot = c.snapshot()
        labels = [c.group, c.name]
        for key in MEMBER_COUNTERS:
            mine[f"pgq_{key}"].add_metric(labels, float(getattr(snapshot, key)))
        for key, is_open in c.breaker_states().items():
            mine[f"pgq_{key}_open"].add_metric(labels, 1.0 if is_open else 0.0)
        mine["pgq_in_flight_messages"].add_metric(labels, float(c.in_flight()))
        for kind, (name, _) in HISTOGRAMS.items():
            merged = self.timings.merged(kind)
            mine[name].add_metric(labels, _buckets(merged), merged.sum)
        yield from mine.values()

    @staticmethod
    def _check_family() -> Any:
        from prometheus_client.core import GaugeMetricFamily

        return GaugeMetricFamily(
            "pgq_group_check_status",
            "the pgq check verdict: 0 OK, 1 WARNING, 2 CRITICAL",
            labels=GROUP_LABELS,
        )

    @staticmethod
    def _age_family(samples: list[tuple[list[str], float]]) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "pgq_group_numbers_age_seconds",
            "seconds since this member read its group's numbers (pgq_group_*)",
            labels=GROUP_LABELS,
        )
        for labels, value in samples:
            family.add_metric(labels, value)
        return family


def _buckets(merged: Merged) -> list[tuple[str, float]]:
    """A merged histogram as Prometheus' cumulative `(le, count)` pairs, +Inf last."""
    bounds = [*(repr(float(b)) for b in merged.bounds), "+Inf"]
    return [(le, float(n)) for le, n in zip(bounds, merged.cumulative, strict=True)]


@contextlib.contextmanager
def serving_metrics(port: int, consumer: Consumer, host: str = DEFAULT_HOST) -> Iterator[None]:
    """Serve `/metrics` on `host`:`port` (a daemon thread) until the block ends.

    The registry is the member's own (its collector beside the process, platform
    and garbage-collector ones), so nothing is shared with other code in the
    process. An address that cannot be bound is a `ConfigError`. Enter it before
    the consumer starts (its latency histograms start with it).
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
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # `[::1]`, as URLs write it
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--metrics-port {port} --metrics-host {host}: cannot serve metrics: {exc}"
        ) from None
    with log_fields(group=consumer.group, member=consumer.name):
        logger.info("serving metrics host=%s port=%d path=/metrics", host, port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
