"""Retry backoff: pure arithmetic, no I/O.

The delay before attempt n+1 after n finished attempts is
``min(maximum, base × 2^(n−1)) × uniform(0.5, 1)`` (DESIGN §4). The random
source is injectable so tests are exact. The breaker's open periods and probe
intervals use the same capped doubling (`capped_exponential`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["capped_exponential", "jitter", "retry_delay"]

# 2.0 ** 1000 is still a finite float; past it `2.0 ** n` raises OverflowError.
# Any base > 1e-300 already reaches +inf (then `maximum`) well before that.
_MAX_EXPONENT = 1000


def capped_exponential(step: int, base: float, maximum: float) -> float:
    """Return ``min(maximum, base × 2^step)`` without overflowing for large `step`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if base < 0 or maximum < 0:
        raise ValueError("base and maximum must be >= 0")
    # float multiplication overflows to inf (no exception); min() then picks maximum.
    return min(maximum, base * 2.0 ** min(step, _MAX_EXPONENT))


def jitter(rng: Callable[[], float] = random.random) -> float:
    """Map ``rng()`` in [0, 1) to a factor in [0.5, 1).

    Jitter only ever shortens a delay, so a configured maximum stays a hard cap,
    while callers that failed together still spread out by up to half the delay.
    """
    return 0.5 + 0.5 * rng()


def retry_delay(
    attempt: int,
    base: float,
    maximum: float,
    rng: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before attempt ``attempt + 1`` after `attempt` finished attempts.

    ``min(maximum, base × 2^(attempt−1)) × uniform(0.5, 1)``; `attempt` must be >= 1.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return capped_exponential(attempt - 1, base, maximum) * jitter(rng)
