"""A member's numbers as OpenTelemetry metrics (the `otel` extra; decision 0043).

`instrument_metrics(consumer)` registers observable instruments that read, when
the SDK collects, the numbers `pgq.metrics` serves to Prometheus, from memory:
nothing on the hot path, no database read of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pgq.consumer.numbers import STALE_AFTER
from pgq.errors import ConfigError, install_extra
from pgq.metrics import BREAKERS, GROUP_METRICS, MEMBER_COUNTERS
from pgq.otel.tracing import A_CLIENT, A_DESTINATION, A_GROUP, INSTRUMENTATION

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider

    from pgq.consumer import Consumer

__all__ = ["instrument_metrics"]


def instrument_metrics(consumer: Consumer, provider: MeterProvider | None = None) -> None:
    """Export `consumer`'s numbers through OpenTelemetry: observable instruments of
    the meter `pgq` (of `provider`, or the global meter provider) that read, when
    the SDK collects, what `pgq.metrics` serves to Prometheus: the running counts
    (`pgq.handled`, `pgq.done`, ...: counters), the breakers
    (`pgq.local_breaker.open`, `pgq.group_breaker.open`: 1 or 0), the rows in
    flight (`pgq.in_flight`), and the group's numbers as the member last read them
    (`pgq.group.lag`, `pgq.group.dead_rows`, ...: `pgq_group_*` renamed, counters
    and gauges as there; none once older than `STALE_AFTER`). Attributes:
    `messaging.consumer.group.name`,
    `messaging.client.id`, and `messaging.destination.name` on the group's.
    Call it before `consumer.start()` (it makes the member read its group's
    numbers: `Consumer.measure()`). Histograms stay Prometheus' only."""
    try:
        from opentelemetry.metrics import Observation, get_meter_provider
    except ImportError:
        raise ConfigError(
            "OpenTelemetry metrics need the 'otel' extra: " + install_extra("otel")
        ) from None
    consumer.measure()
    meter = (provider or get_meter_provider()).get_meter(INSTRUMENTATION)
    mine = {A_GROUP: consumer.group, A_CLIENT: consumer.name}

    def count(key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            if not consumer.started:
                return []
            return [Observation(getattr(consumer.snapshot(), key), mine)]

        return observe

    def breaker(key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            if not consumer.started:
                return []
            return [Observation(1 if consumer.breaker_states()[key] else 0, mine)]

        return observe

    def in_flight(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(consumer.in_flight(), mine)] if consumer.started else []

    def group(read: Callable[[Any], float | None]) -> Callable[[CallbackOptions], Any]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            numbers = consumer.group_numbers()
            if numbers is None or consumer.clock() - numbers.taken > STALE_AFTER:
                return []
            value = read(numbers.status)
            if value is None:
                return []
            attrs = {A_GROUP: consumer.group, A_DESTINATION: numbers.status.topic}
            return [Observation(value, attrs)]

        return observe

    for key in MEMBER_COUNTERS:
        meter.create_observable_counter(
            f"pgq.{key}", [count(key)], unit="{message}", description=f"messages {key}"
        )
    for key in BREAKERS:
        meter.create_observable_gauge(
            f"pgq.{key}.open",
            [breaker(key)],
            description=f"1 while the {key.replace('_', ' ')} is open",
        )
    meter.create_observable_gauge(
        "pgq.in_flight",
        [in_flight],
        unit="{message}",
        description="rows this member holds a lease on",
    )
    for m in GROUP_METRICS:
        name = "pgq.group." + m.name.removeprefix("pgq_group_")
        if m.kind == "counter":
            meter.create_observable_counter(name, [group(m.value)], description=m.doc)
        else:
            meter.create_observable_gauge(name, [group(m.value)], description=m.doc)
