"""Retry backoff arithmetic (DESIGN §4)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgq.backoff import capped_exponential, jitter, retry_delay


def const(value: float):
    return lambda: value


@pytest.mark.parametrize(
    ("attempt", "rng_value", "expected"),
    [
        (1, 0.0, 1.0),  # 2 × 2^0 × 0.5
        (1, 0.5, 1.5),  # 2 × 2^0 × 0.75
        (2, 0.0, 2.0),  # 2 × 2^1 × 0.5
        (3, 0.0, 4.0),
        (5, 0.0, 16.0),  # 32 × 0.5
        (6, 0.0, 30.0),  # capped at 60, × 0.5
        (6, 0.5, 45.0),
        (100, 0.0, 30.0),
    ],
)
def test_retry_delay_exact(attempt: int, rng_value: float, expected: float) -> None:
    assert retry_delay(attempt, 2.0, 60.0, rng=const(rng_value)) == expected


def test_retry_delay_huge_attempt_does_not_overflow() -> None:
    assert retry_delay(10**9, 1.0, 300.0, rng=const(0.0)) == 150.0
    assert retry_delay(1025, 1e-300, 7.0, rng=const(0.0)) == 3.5


def test_retry_delay_zero_base_is_zero() -> None:
    assert retry_delay(50, 0.0, 10.0, rng=const(0.3)) == 0.0


@pytest.mark.parametrize("attempt", [0, -1])
def test_retry_delay_needs_a_finished_attempt(attempt: int) -> None:
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(attempt, 1.0, 10.0)


def test_capped_exponential() -> None:
    assert capped_exponential(0, 5.0, 300.0) == 5.0
    assert capped_exponential(3, 5.0, 300.0) == 40.0
    assert capped_exponential(6, 5.0, 300.0) == 300.0
    assert capped_exponential(10**12, 5.0, 300.0) == 300.0
    with pytest.raises(ValueError):
        capped_exponential(-1, 5.0, 300.0)
    with pytest.raises(ValueError):
        capped_exponential(1, -5.0, 300.0)


def test_jitter_maps_unit_interval_to_upper_half() -> None:
    assert jitter(const(0.0)) == 0.5
    assert jitter(const(0.5)) == 0.75
    assert jitter(const(0.999)) < 1.0


unit = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)
positive = st.floats(min_value=1e-3, max_value=1e4)


@given(attempt=st.integers(1, 5000), base=positive, maximum=positive, r=unit)
def test_retry_delay_within_jitter_band(
    attempt: int, base: float, maximum: float, r: float
) -> None:
    delay = retry_delay(attempt, base, maximum, rng=const(r))
    nominal = min(maximum, base * 2.0 ** min(attempt - 1, 1000))
    assert 0.5 * nominal <= delay <= nominal <= maximum
    assert math.isfinite(delay)


@given(attempt=st.integers(1, 2000), base=positive, maximum=positive, r=unit)
def test_retry_delay_monotonic_in_attempt(
    attempt: int, base: float, maximum: float, r: float
) -> None:
    assert retry_delay(attempt, base, maximum, rng=const(r)) <= retry_delay(
        attempt + 1, base, maximum, rng=const(r)
    )
