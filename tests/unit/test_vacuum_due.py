"""When a member vacuums `delivery` (decision 0021): the threshold alone."""

from __future__ import annotations

import pytest

from pgq.store.housekeeping import vacuum_due


@pytest.mark.parametrize(
    ("dead", "live", "due"),
    [
        (10_000, 0, False),  # too few to bother
        (60_000, 10_000, True),  # dead rows dominate a small live set
        (60_000, 40_000, False),  # not yet twice the live rows
        (90_000, 40_000, True),
        # behind a big backlog dead rows never reach twice the live ones, but they sit
        # at the head of the ready index where every claim walks over them
        (150_000, 1_000_000, False),
        (250_000, 1_000_000, True),
    ],
)
def test_vacuum_due(dead: int, live: int, due: bool) -> None:
    assert vacuum_due(dead, live) is due
