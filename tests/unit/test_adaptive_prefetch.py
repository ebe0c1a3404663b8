"""The adaptive prefetch's bound, with an injected clock (pgq/consumer/prefetch.py)."""

from __future__ import annotations

import pytest

from pgq.consumer.prefetch import HORIZON, WINDOW, AdaptivePrefetch, claim_limit, claim_want

STEP = 1 / 16
"""The tests' clock step: a little over `WINDOW`, and exact in binary (steps of
`WINDOW` itself may add up a hair short of it)."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced(pace: float, *, low: int = 16, high: int = 400, lease: float = 30.0) -> int:
    """The bound after rows finished at `pace` per second for a few windows."""
    clock = Clock()
    prefetch = AdaptivePrefetch(low, high, lease, clock)
    finished = 0.0
    for _ in range(20):
        clock.now += STEP
        finished += pace * STEP
        prefetch.observe(int(finished))
    return prefetch.bound


def test_it_starts_at_the_low_bound_and_waits_a_window_before_changing() -> None:
    clock = Clock()
    prefetch = AdaptivePrefetch(16, 400, 30.0, clock)
    assert prefetch.bound == 16
    clock.now += WINDOW / 2
    assert prefetch.observe(10_000) is None  # too short a stretch to measure
    clock.now += STEP
    assert prefetch.observe(10_000) == 400
    assert prefetch.bound == 400


def test_fast_handlers_get_the_high_bound() -> None:
    assert paced(20_000) == 400


def test_slow_handlers_keep_the_low_bound() -> None:
    # 2 members × 8 workers × 100 ms handlers: 80 rows/s per member
    assert paced(80) == 16


def test_in_between_the_bound_holds_the_horizon_of_work() -> None:
    assert paced(2_000) == pytest.approx(2_000 * HORIZON, abs=2)


def test_the_lease_caps_the_bound() -> None:
    # 4,000 rows/s would want 200 buffered, but a 0.1 s lease only lets 100 start in time
    assert paced(4_000, lease=0.1) == 100


def test_an_unchanged_bound_reports_nothing() -> None:
    clock = Clock()
    prefetch = AdaptivePrefetch(16, 400, 30.0, clock)
    clock.now += STEP
    assert prefetch.observe(0) is None  # idle: stays at the low bound


def test_a_falling_pace_is_taken_at_once() -> None:
    """Hoarding is the risk of a big buffer: one slow window brings the bound down."""
    clock = Clock()
    prefetch = AdaptivePrefetch(16, 400, 30.0, clock)
    finished = 0
    for _ in range(5):
        clock.now += STEP
        finished += 1_000
        prefetch.observe(finished)
    assert prefetch.bound == 400
    clock.now += STEP
    assert prefetch.observe(finished + 5) == 16


# --- the fetcher's claim size (`claim_want`, `claim_limit`) ------------------------


def test_the_fetcher_waits_for_half_a_batch_or_half_the_pool() -> None:
    assert claim_want(100, 800) == 50
    assert claim_want(100, 16) == 8
    assert claim_want(1, 16) == 1
    assert claim_want(100, 1) == 1  # never zero: a one-row pool still claims


def limit(**given: int | None) -> tuple[int, bool]:
    base: dict[str, int | None] = {
        "batch_size": 100,
        "free": 400,
        "ramped": 400,
        "budget": None,
        "room": 10_000,
    }
    base.update(given)
    return claim_limit(**base)  # type: ignore[arg-type]


def test_a_claim_takes_at_most_a_batch() -> None:
    assert limit() == (100, False)


@pytest.mark.parametrize("bound", ["free", "ramped", "budget"])
def test_each_bound_caps_the_claim(bound: str) -> None:
    assert limit(**{bound: 7}) == (7, False)


def test_no_budget_left_claims_nothing_and_is_not_the_ackers_doing() -> None:
    assert limit(budget=0) == (0, False)


def test_the_ackers_room_caps_the_claim() -> None:
    assert limit(room=30) == (30, False)


def test_no_room_at_the_acker_holds_the_claim_back() -> None:
    assert limit(room=0) == (0, True)


def test_a_full_pool_is_not_held_back_by_the_acker() -> None:
    """Nothing to claim anyway: the fetcher waits for space, not for the acker."""
    assert limit(free=0, room=0) == (0, False)


@pytest.mark.parametrize(
    ("given", "claimed"),
    [({"free": 77}, 64), ({"free": 99}, 96), ({"ramped": 80}, 80), ({"room": 95}, 80)],
)
def test_a_claim_short_of_a_batch_takes_a_multiple_of_16_rows(given, claimed) -> None:
    """Failed before: every size from 64 to 99 was a claim statement of its own (a
    run of the adaptive prefetch compiled a dozen of them, ~4 ms of CPU each)."""
    assert limit(**given) == (claimed, False)


def test_a_full_batch_and_small_claims_are_not_rounded_here() -> None:
    assert limit(batch_size=100) == (100, False)
    assert limit(batch_size=77) == (77, False)
    assert limit(free=63) == (63, False)  # the store rounds it to a power of two
