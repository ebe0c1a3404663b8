"""The member's latency histograms (`pgq.consumer.timing`): buckets as Prometheus
counts them (`value <= le`), one histogram per writer, added up at a scrape."""

from __future__ import annotations

import threading

from pgq.consumer.timing import ACK, HANDLER, HANDLER_BUCKETS, Histogram, Timings


def test_a_value_on_a_bound_counts_in_that_bucket():
    h = Histogram((0.1, 1.0))
    for value in (0.0, 0.1, 0.10001, 1.0, 5.0):
        h.observe(value)
    assert h.counts == [2, 2, 1]
    assert abs(h.sum - 6.20001) < 1e-9


def test_merged_adds_every_writer_cumulatively_and_keeps_retired_ones():
    timings = Timings()
    first, second = timings.histogram(HANDLER), timings.histogram(HANDLER)
    first.observe(0.0001)
    second.observe(0.002)
    second.observe(1000.0)  # above every bound: only in +Inf
    del first  # a retired worker's counts stay (a counter never goes down)
    merged = timings.merged(HANDLER)
    assert merged.bounds == HANDLER_BUCKETS
    assert len(merged.cumulative) == len(HANDLER_BUCKETS) + 1
    assert merged.cumulative[0] == 1  # le=0.0001
    assert merged.cumulative[HANDLER_BUCKETS.index(0.0025)] == 2
    assert merged.cumulative[-2] == 2 and merged.count == 3
    assert list(merged.cumulative) == sorted(merged.cumulative)
    assert abs(merged.sum - 1000.0021) < 1e-9
    assert timings.merged(ACK).count == 0


def test_writers_in_threads_lose_nothing():
    timings = Timings()

    def write() -> None:
        h = timings.histogram(HANDLER)
        for i in range(10_000):
            h.observe(i / 10_000)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert timings.merged(HANDLER).count == 40_000
