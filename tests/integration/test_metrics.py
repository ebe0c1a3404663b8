"""Prometheus metrics of a running member (extra `metrics`)."""

from __future__ import annotations

import pytest
from helpers import wait_until

import pgq
from pgq.metrics import ConsumerCollector

pytest.importorskip("prometheus_client")


def samples(consumer: pgq.Consumer) -> dict[str, float]:
    return {
        s.name: s.value for family in ConsumerCollector(consumer).collect() for s in family.samples
    }


def test_member_counts_breakers_and_group_numbers(engine):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    pgq.publish(engine, "t", {"poison": True})

    def handler(msg: pgq.Message) -> None:
        if msg.payload.get("poison"):
            raise pgq.PermanentError("bad")

    with pgq.Consumer(engine, "g", handler, workers=2, poll_interval=0.1) as consumer:
        wait_until(lambda: pgq.status(engine, "g")["lag"] == 0, 20, "the group to drain")
        found = samples(consumer)
    assert found["pgq_done_total"] == 10 and found["pgq_dead_total"] == 1
    assert found["pgq_local_breaker_open"] == 0 and found["pgq_group_breaker_open"] == 0
    assert found["pgq_group_lag"] == 0 and found["pgq_group_dead_rows"] == 1
    assert found["pgq_group_check_status"] == 2  # a real dead letter: CRITICAL
