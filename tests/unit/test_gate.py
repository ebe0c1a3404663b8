"""The member's breaker gate: epochs, probes and the group state (no database)."""

from __future__ import annotations

import datetime as dt
import logging

from helpers import FakeClock

from pgq.consumer.gate import RAMP_SECONDS, Gate
from pgq.records import Claimed, Lease, Message, Outcome
from pgq.settings import Settings


def make_gate(**settings: object) -> tuple[Gate, FakeClock, list[int]]:
    clock = FakeClock()
    changes: list[int] = []
    base = {"breaker_window": 4, "breaker_min_calls": 2, "breaker_open_for": 1.0}
    gate = Gate(Settings(**{**base, **settings}), clock)
    gate.on_change(lambda: changes.append(1))
    return gate, clock, changes


def row(mid: int = 1, epoch: int = 0, probe: bool = False) -> Claimed:
    msg = Message(mid, "t", "g", None, {}, None, 1, dt.datetime.now(dt.timezone.utc))
    return Claimed(msg, Lease(mid, 1), attempts=0, epoch=epoch, probe=probe)


def systemic(r: Claimed) -> Outcome:
    return Outcome(r, "retry", error_class="systemic", error="ConnectionError")


def test_systemic_failures_trip_and_close_both_gates():
    gate, _, changes = make_gate()
    assert gate.claim_mode() == "normal" and gate.admit(row())
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    assert gate.local.is_open and gate.is_open()
    assert gate.local_report() == ("open", 0)
    assert not gate.admit(row(3))
    assert gate.claim_mode() == "closed"  # open_for not elapsed yet
    assert changes


def test_attempts_from_an_older_epoch_do_not_count():
    gate, _, _ = make_gate()
    gate.see_group("CLOSED", 2)
    gate.observe(systemic(row(1, epoch=1)))
    gate.observe(systemic(row(2, epoch=1)))
    assert not gate.local.is_open


def test_snoozes_and_message_failures_do_not_trip():
    gate, _, _ = make_gate()
    for i in range(10):
        gate.observe(Outcome(row(i), "snooze", delay=1.0))
        gate.observe(Outcome(row(i), "retry", error_class="message", error="ValueError"))
    assert not gate.local.is_open


def test_one_local_probe_after_open_for_and_its_success_closes():
    gate, clock, _ = make_gate()
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    clock.now += 1.0
    assert gate.claim_mode() == "probe"
    assert gate.claim_mode() == "closed"  # exactly one probe in flight
    probe = row(3, probe=True)
    assert gate.admit(probe)
    gate.observe(Outcome(probe, "done"))
    assert not gate.local.is_open and gate.claim_mode() == "normal"


def test_group_open_closes_the_gate_and_local_probes_wait():
    gate, clock, _ = make_gate()
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    gate.see_group("OPEN", 1)
    clock.now += 10.0
    assert gate.claim_mode() == "closed"  # the group's prober is the only traffic
    assert not gate.admit(row(3))
    # a failure reported while the group is open does not feed the local window
    gate.observe(systemic(row(4, epoch=1)))
    assert gate.local.trips == 1


def test_group_close_does_not_close_the_local_breaker_but_probes_it_at_once():
    gate, _, _ = make_gate(breaker_open_for=60.0, breaker_open_for_max=60.0)
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    gate.see_group("OPEN", 1)
    gate.see_group("CLOSED", 2)
    assert gate.local.is_open  # not healed by the group
    assert gate.claim_mode() == "probe"  # but re-verifies itself now, not in 60 s
    probe = row(3, epoch=2, probe=True)
    gate.observe(systemic(probe))
    assert gate.local.is_open
    assert gate.local_report() == ("open", 2)  # a failed re-check counts under the new epoch


def test_stale_group_reports_are_ignored():
    gate, _, _ = make_gate()
    assert gate.see_group("OPEN", 3)
    assert not gate.see_group("CLOSED", 2)
    assert gate.group_open and gate.epoch == 3


def test_claims_ramp_up_after_a_group_close():
    gate, clock, _ = make_gate()
    gate.see_group("OPEN", 1)
    gate.see_group("CLOSED", 2)
    assert gate.ramp(100) == 1
    clock.now += RAMP_SECONDS / 2
    assert gate.ramp(100) == 50
    clock.now += RAMP_SECONDS
    assert gate.ramp(100) == 100


def test_a_local_probe_released_unstarted_lets_the_breaker_probe_again():
    """Issue 10 #6: the pool is drained when a gate closes; a local probe row among
    the released rows never ran, and the local breaker must not wait for it for good."""
    gate, clock, _ = make_gate()
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    clock.advance(1.0)
    assert gate.claim_mode() == "probe"
    assert gate.claim_mode() == "closed"  # one probe at a time
    gate.released([row(3), row(4, probe=True)])
    assert gate.claim_mode() == "probe"


def test_releasing_ordinary_rows_does_not_forget_a_probe_in_flight():
    gate, clock, _ = make_gate()
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    clock.advance(1.0)
    assert gate.claim_mode() == "probe"
    gate.released([row(3)])
    assert gate.claim_mode() == "closed"


def test_pre_outage_failures_do_not_count_after_a_global_close():
    """Issue 10 #7: a member whose local breaker never tripped starts its window
    afresh at a global close; one failure under the new epoch must not trip it."""
    gate, _, _ = make_gate()
    gate.observe(systemic(row(1)))  # one systemic failure before the outage
    gate.see_group("OPEN", 1)
    gate.see_group("CLOSED", 2)
    gate.observe(systemic(row(2, epoch=2)))
    assert not gate.local.is_open
    gate.observe(systemic(row(3, epoch=2)))
    assert gate.local.is_open  # two failures under the new epoch do


def test_no_local_probe_starts_while_the_group_is_open():
    """Issue 10 (smaller): while the group is OPEN its prober is the only traffic."""
    gate, clock, _ = make_gate()
    gate.observe(systemic(row(1)))
    gate.observe(systemic(row(2)))
    clock.advance(1.0)
    assert gate.admit(row(3, probe=True))
    gate.see_group("OPEN", 1)
    assert not gate.admit(row(3, probe=True))


def test_each_group_transition_is_logged_once_with_what_made_it(caplog):
    gate, _, _ = make_gate()
    with caplog.at_level(logging.INFO, logger="pgq.breaker"):
        gate.see_group("OPEN", 1, by="quorum")
        gate.see_group("OPEN", 1)  # the heartbeat and the prober read it again
        gate.see_group("CLOSED", 2, by="probe")
        gate.see_group("CLOSED", 2)
        gate.see_group("OPEN", 3)  # another member opened it
    lines = [(r.getMessage(), getattr(r, "by", None)) for r in caplog.records]
    assert lines == [
        ("group breaker open epoch=1", "quorum"),
        ("group breaker closed epoch=2", "probe"),
        ("group breaker open epoch=3", None),
    ]
