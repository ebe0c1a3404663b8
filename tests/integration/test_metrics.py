"""Prometheus metrics of a running member (extra `metrics`): its counts, breakers,
rows in flight and latency histograms, and its group's numbers."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import FAST, wait_until

import pgq
import pgq.metrics
from pgq.consumer.numbers import STALE_AFTER
from pgq.metrics import ConsumerCollector

pytest.importorskip("prometheus_client")


def samples(collector: ConsumerCollector) -> dict[str, float]:
    return {s.name: s.value for family in collector.collect() for s in family.samples}


def test_member_counts_breakers_and_group_numbers(engine):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    pgq.publish(engine, "t", {"poison": True})

    def handler(msg: pgq.Message) -> None:
        if msg.payload.get("poison"):
            raise pgq.PermanentError("bad")

    consumer = pgq.Consumer(engine, "g", handler, workers=2, poll_interval=0.1)
    collector = ConsumerCollector(consumer)  # before it starts: it reads its group's numbers
    with consumer:
        wait_until(lambda: pgq.status(engine, "g")["lag"] == 0, 20, "the group to drain")

        def drained() -> dict[str, float] | None:  # the member's next read of its numbers
            found = samples(collector)
            return found if found.get("pgq_group_lag") == 0 else None

        found = wait_until(drained, 20, "the metrics to report no lag")
    assert found["pgq_done_total"] == 10 and found["pgq_dead_total"] == 1
    assert found["pgq_local_breaker_open"] == 0 and found["pgq_group_breaker_open"] == 0
    assert found["pgq_group_lag"] == 0 and found["pgq_group_dead_rows"] == 1
    assert found["pgq_group_check_status"] == 2  # a real dead letter: CRITICAL


def histogram(consumer_samples: list, name: str) -> dict[str, float]:
    """`name`'s `_count`, `_sum` and buckets (`le`) from a collect's samples."""
    found: dict[str, float] = {}
    for s in consumer_samples:
        if s.name == f"{name}_bucket":
            found[s.labels["le"]] = s.value
        elif s.name in (f"{name}_count", f"{name}_sum"):
            found[s.name.removeprefix(name + "_")] = s.value
    return found


def test_latency_histograms_and_rows_in_flight(engine):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(6)])
    running, release = threading.Event(), threading.Event()

    def handler(msg: pgq.Message) -> None:
        if msg.payload["i"] == 0:
            running.set()
            assert release.wait(20)
        else:
            time.sleep(0.03)

    consumer = pgq.Consumer(engine, "g", handler, workers=2, poll_interval=0.1)
    collector = ConsumerCollector(consumer)  # before it starts: its threads time their work
    with consumer:
        assert running.wait(20)
        wait_until(
            lambda: pgq.status(engine, "g")["counts"]["done"] == 5, 20, "the others to finish"
        )
        held = [s for f in collector.collect() for s in f.samples]
        assert [s.value for s in held if s.name == "pgq_in_flight_messages"] == [1]
        release.set()
        wait_until(lambda: pgq.status(engine, "g")["lag"] == 0, 20, "the group to drain")
        found = [s for f in collector.collect() for s in f.samples]

    handled = histogram(found, "pgq_handler_duration_seconds")
    assert handled["count"] == 6 and handled["+Inf"] == 6
    assert handled["0.025"] == 0 and handled["300.0"] == 6  # each took 30 ms or more
    assert 6 * 0.03 <= handled["sum"] < 20
    claims = histogram(found, "pgq_claim_duration_seconds")
    acks = histogram(found, "pgq_ack_duration_seconds")
    assert claims["count"] >= 1 and claims["sum"] > 0 and claims["+Inf"] == claims["count"]
    assert acks["count"] >= 1 and acks["sum"] > 0 and acks["+Inf"] == acks["count"]
    assert [s.value for s in found if s.name == "pgq_in_flight_messages"] == [0]
    labels = {s.labels["member"] for s in found if s.name.startswith("pgq_handler_duration")}
    assert labels == {consumer.name}


def test_a_consumer_not_measured_times_nothing(engine):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(3)])
    consumer = pgq.Consumer(engine, "g", lambda m: None, workers=1, poll_interval=0.1)
    assert consumer.run(until_empty=True).done == 3
    timings = consumer.measure()  # asked for only now: the run recorded nothing
    for kind in ("handler", "claim", "ack"):
        assert timings.merged(kind).count == 0


def test_group_numbers_come_from_the_members_last_read_with_its_age(engine, monkeypatch):
    """A scrape reads no database (decision 0031): the group's numbers are the ones
    the member last read on its own connection, served with their age, and no
    longer served once that read is older than `STALE_AFTER`."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    consumer = pgq.Consumer(engine, "g", lambda m: None, workers=1, **FAST)
    collector = ConsumerCollector(consumer)
    assert samples(collector) == {}  # not started: nothing read yet, and nothing read now
    with consumer:
        found = wait_until(
            lambda: (f := samples(collector)).get("pgq_group_live_members") == 1 and f,
            20,
            "the member's first read of its group's numbers",
        )
        assert 0 <= found["pgq_group_numbers_age_seconds"] < STALE_AFTER
        assert found["pgq_group_check_status"] == 0 and found["pgq_group_lag"] == 0
        monkeypatch.setattr(pgq.metrics, "STALE_AFTER", -1.0)
        stale = samples(collector)
    assert "pgq_group_numbers_age_seconds" in stale and "pgq_handled_total" in stale
    assert not any(name.startswith(("pgq_group_lag", "pgq_group_check")) for name in stale)


def test_a_handler_that_returns_after_its_timeout_is_timed_once(engine):
    """The watchdog times the run it abandons; the late return adds nothing."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(4)])

    def handler(msg: pgq.Message) -> None:
        if msg.payload["i"] == 0:
            time.sleep(1.0)  # past handler_timeout, then returns

    consumer = pgq.Consumer(
        engine, "g", handler, workers=2, handler_timeout=0.3, max_attempts=1, **FAST
    )
    collector = ConsumerCollector(consumer)
    summary = consumer.run(until_empty=True, max_runtime=30)
    wait_until(
        lambda: not any(t.name.startswith("pgq-worker") for t in threading.enumerate()),
        10,
        "the abandoned worker to return",
    )
    found = histogram(
        [s for f in collector.collect() for s in f.samples], "pgq_handler_duration_seconds"
    )
    assert summary.handled == 4 and summary.dead == 1, summary
    assert found["count"] == 4 and found["sum"] >= 0.3
