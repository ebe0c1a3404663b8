"""The prober's and the heartbeat's decisions as pure functions (pgq/breaker.py):
what an elected prober does next, what a probe that did not succeed means, when a
heartbeat tries to open the group and when a member runs a prober."""

from __future__ import annotations

import pytest

from pgq.breaker import (
    LeadMove,
    judge_probe,
    lead_move,
    needs_prober,
    probe_delay,
    should_try_open,
)
from pgq.records import BreakerState, DrainState, LocalBreakerState

OPEN, CLOSED = BreakerState.OPEN, BreakerState.CLOSED


@pytest.mark.parametrize("state", [OPEN, CLOSED])
@pytest.mark.parametrize("due", [True, False])
@pytest.mark.parametrize("one_shot", [True, False])
def test_an_owed_reconciliation_comes_first(state: str, due: bool, one_shot: bool) -> None:
    assert lead_move(state, True, due, one_shot=one_shot) is LeadMove.RECONCILE


@pytest.mark.parametrize("one_shot", [True, False])
def test_a_closed_group_that_owes_nothing_finishes_the_prober(one_shot: bool) -> None:
    assert lead_move(CLOSED, False, False, one_shot=one_shot) is LeadMove.FINISHED


@pytest.mark.parametrize("one_shot", [True, False])
def test_an_open_group_with_a_probe_due_probes(one_shot: bool) -> None:
    assert lead_move(OPEN, False, True, one_shot=one_shot) is LeadMove.PROBE


def test_an_open_group_without_a_probe_due_waits_or_ends_a_one_shot_run() -> None:
    assert lead_move(OPEN, False, False, one_shot=False) is LeadMove.WAIT
    assert lead_move(OPEN, False, False, one_shot=True) is LeadMove.STOP


def judge(systemic: bool, failures: int, turns: int, one_shot: bool = False, prober_turns: int = 3):
    return judge_probe(
        systemic,
        failures,
        turns,
        interval=5.0,
        interval_max=300.0,
        prober_turns=prober_turns,
        one_shot=one_shot,
    )


def test_a_systemic_probe_failure_doubles_the_interval_and_counts_a_turn() -> None:
    verdicts = [judge(True, n, n) for n in range(3)]
    assert [v.failures for v in verdicts] == [1, 2, 3]
    assert [v.delay for v in verdicts] == [5.0, 10.0, 20.0]
    assert [v.turns for v in verdicts] == [1, 2, 3]
    assert all(v.systemic for v in verdicts)


def test_the_interval_stops_at_its_maximum() -> None:
    assert judge(True, 20, 0).delay == 300.0


def test_after_its_turns_the_prober_sits_out_the_next_election() -> None:
    assert judge(True, 0, 1, prober_turns=3).then is None
    assert judge(True, 0, 2, prober_turns=3).then is LeadMove.SIT_OUT
    assert judge(True, 0, 0, prober_turns=1).then is LeadMove.SIT_OUT


def test_an_inconclusive_probe_keeps_the_interval_and_starts_the_turns_again() -> None:
    verdict = judge(False, 3, 2)
    assert not verdict.systemic
    assert verdict.failures == 3  # not one more: the row failed, not the dependency
    assert verdict.delay == probe_delay(3, 5.0, 300.0)
    assert verdict.turns == 0
    assert verdict.then is None


def test_an_inconclusive_first_probe_waits_the_base_interval() -> None:
    assert judge(False, 0, 0).delay == 5.0


@pytest.mark.parametrize("systemic", [True, False])
def test_a_one_shot_run_stops_after_any_probe_that_did_not_close(systemic: bool) -> None:
    assert judge(systemic, 0, 5, one_shot=True).then is LeadMove.STOP


def test_a_heartbeat_tries_to_open_only_on_a_trip_under_the_current_epoch() -> None:
    local_open, local_closed = LocalBreakerState.OPEN, LocalBreakerState.CLOSED
    assert should_try_open(CLOSED, local_open, 4, 4)
    assert not should_try_open(CLOSED, local_open, 3, 4)  # an outage since closed
    assert not should_try_open(CLOSED, local_open, None, 4)
    assert not should_try_open(CLOSED, local_closed, 4, 4)
    assert not should_try_open(OPEN, local_open, 4, 4)  # open already


def test_a_member_runs_a_prober_while_open_or_while_a_reconciliation_is_owed() -> None:
    assert needs_prober(OPEN, False)
    assert needs_prober(CLOSED, True)
    assert not needs_prober(CLOSED, False)


def drain(**given: int | bool) -> DrainState:
    base: dict = {"ready_now": 0, "waiting_retry": 0, "due_soon": 0, "held": 0}
    base["reconciling"] = False
    return DrainState(**{**base, **given})


def test_a_group_is_empty_for_a_run_with_nothing_to_wait_for() -> None:
    assert drain().empty
    assert drain(waiting_retry=5).empty  # later retries are left for a later run
    for waiting in ("ready_now", "due_soon", "held"):
        assert not drain(**{waiting: 1}).empty
    assert not drain(reconciling=True).empty
