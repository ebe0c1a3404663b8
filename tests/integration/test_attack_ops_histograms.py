"""Attack (issue 21, decision 0031): the handler histogram under 8 workers, with a
handler that hangs past `handler_timeout`, and with the probes of an outage.

The watchdog abandons the hung run, records it as a failure and replaces the
worker: the run counts in `pgq_handled_total` (and dead). But the worker only
observes a handler's duration when the handler returns (`Worker.execute`), so a
handler that hangs — the slowest run there is, the one a latency alert exists
for — never reaches `pgq_handler_duration_seconds`: its count falls behind the
attempts the member finished, and the top buckets stay empty.
"""

from __future__ import annotations

import threading

import pytest
from helpers import FAST, LONE_OUTAGE, wait_until

import pgq
from pgq.consumer.prober import PROBE_THREAD
from pgq.metrics import ConsumerCollector

pytest.importorskip("prometheus_client")

N = 40


def test_a_handler_abandoned_at_its_timeout_is_in_the_handler_histogram(engine):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(N)])
    release = threading.Event()

    def handler(msg: pgq.Message) -> None:
        if msg.payload["i"] == 0:
            release.wait(60)  # hangs past handler_timeout

    consumer = pgq.Consumer(
        engine, "g", handler, workers=8, handler_timeout=0.5, max_attempts=1, **FAST
    )
    collector = ConsumerCollector(consumer)  # before it starts: its threads time their work
    try:
        summary = consumer.run(until_empty=True, max_runtime=60)
        found = {
            s.name: s.value
            for family in collector.collect()
            for s in family.samples
            if "le" not in s.labels
        }
    finally:
        release.set()
    assert summary.handled == N and summary.dead == 1, summary
    assert found["pgq_handled_total"] == N
    assert found["pgq_handler_duration_seconds_count"] == found["pgq_handled_total"], (
        f"{found['pgq_handler_duration_seconds_count']:g} handler runs timed,"
        f" {found['pgq_handled_total']:g} finished: the one past handler_timeout is missing"
    )


def test_probe_runs_are_in_the_handler_histogram(engine):
    """A member that probes its group during an outage runs the handler on the
    probe row in a thread of its own (`Prober._attempt`), which times nothing:
    those runs count in `pgq_handled_total` and never in the histogram, so
    during an outage — when the probes are the only handler runs — the latency
    of the dependency being probed is invisible."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(30)])
    down = threading.Event()
    down.set()
    probes: list[int] = []

    def handler(msg: pgq.Message) -> None:
        if threading.current_thread().name == PROBE_THREAD:
            probes.append(msg.id)
        if down.is_set():
            raise pgq.SystemicError("dependency down")

    consumer = pgq.Consumer(engine, "g", handler, **LONE_OUTAGE)
    collector = ConsumerCollector(consumer)
    with consumer:
        wait_until(lambda: len(probes) >= 2, 60, "two probes of the open group")
        down.clear()
        wait_until(lambda: pgq.status(engine, "g")["lag"] == 0, 60, "the group to drain")
        found = {
            s.name: s.value
            for family in collector.collect()
            for s in family.samples
            if "le" not in s.labels
        }
    assert found["pgq_handler_duration_seconds_count"] == found["pgq_handled_total"], (
        f"{found['pgq_handler_duration_seconds_count']:g} handler runs timed,"
        f" {found['pgq_handled_total']:g} finished, {len(probes)} of them probes"
    )
