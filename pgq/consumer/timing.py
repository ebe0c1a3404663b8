"""Latency histograms a member records while its metrics are served.

Nothing here is used unless metrics are asked for (`Consumer.measure()`, which
`pgq consume --metrics-port` and `pgq.metrics.ConsumerCollector` call): a role
then takes a `Histogram` of its own when it starts, and otherwise holds None
and records nothing (no clock read, no lock). What is timed:

- `handler`: each handler run (seconds), recorded once per finished attempt: by
  the worker that ran it, by the watchdog for a run it abandoned at
  `handler_timeout` (timed up to then; the late return records nothing), and by
  the prober for a probe's run, so its count equals `pgq_handled_total`;
- `claim`: each claim statement of the fetcher, waiting for its connection included;
- `ack`: each batch of outcomes the acker writes (one statement, two when it
  mixes successes and failures), waiting for its connection included.

A `Histogram` is written by one thread only, so an observation takes no lock
(decision 0031 measures what one costs); a scrape reads every writer's counts
and adds them up. A scrape that reads while a writer writes may see its latest
observation in the count and not yet in the sum: one observation, once.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ACK", "CLAIM", "HANDLER", "Histogram", "Merged", "Timings"]

HANDLER = "handler"
CLAIM = "claim"
ACK = "ack"

HANDLER_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
"""Upper bounds (seconds) of the handler histogram: 100 µs to `handler_timeout`'s default."""

STATEMENT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the claim and ack histograms."""

BUCKETS: dict[str, tuple[float, ...]] = {
    HANDLER: HANDLER_BUCKETS,
    CLAIM: STATEMENT_BUCKETS,
    ACK: STATEMENT_BUCKETS,
}


class Histogram:
    """Observations counted by bucket (`value <= bound`, Prometheus' `le`), and their
    sum. One writer thread only: `observe` takes no lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


@dataclass(frozen=True, slots=True)
class Merged:
    """Every writer's histogram of one kind, added up: cumulative counts per upper
    bound (the last is +Inf, and equals `count`), and the sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Timings:
    """The histograms of one member, by kind (`HANDLER`, `CLAIM`, `ACK`); each role
    that records asks for its own with `histogram(kind)`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers: dict[str, list[Histogram]] = {kind: [] for kind in BUCKETS}

    def histogram(self, kind: str) -> Histogram:
        """A new histogram of `kind` for one writer thread (kept: its counts stay in
        the totals after the thread is gone, as a counter never goes down)."""
        h = Histogram(BUCKETS[kind])
        with self._lock:
            self._writers[kind].append(h)
        return h

    def merged(self, kind: str) -> Merged:
        """Every writer's counts of `kind`, added up."""
        bounds = BUCKETS[kind]
        with self._lock:
            writers = list(self._writers[kind])
        counts = [0] * (len(bounds) + 1)
        total = 0.0
        for h in writers:
            for i, n in enumerate(list(h.counts)):
                counts[i] += n
            total += h.sum
        running, cumulative = 0, []
        for n in counts:
            running += n
            cumulative.append(running)
        return Merged(bounds, tuple(cumulative), total)
