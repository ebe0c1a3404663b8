"""The store maps a claim's rows by the column names `CLAIMED` and `LEASED` list, by
position: these tests bind each list to the statements whose rows it names, so a
column added, dropped or moved in a statement fails here, not as a payload read
from the wrong column at run time."""

from __future__ import annotations

import pytest

from pgq.sql import breaker as breaker_sql
from pgq.sql import claim as claim_sql


def columns(statement: object) -> tuple[str, ...]:
    return tuple(c.key for c in statement.selected_columns)  # type: ignore[attr-defined]


@pytest.mark.parametrize("limit", [1, 2, 64, 100])
def test_a_claim_returns_the_columns_claimed_names(limit):
    assert columns(claim_sql.claim(limit, True)) == claim_sql.CLAIMED
    assert columns(claim_sql.claim(limit, False)) == claim_sql.LEASED


@pytest.mark.parametrize("kind", breaker_sql.PROBE_KINDS)
@pytest.mark.parametrize("probed", [False, True])
def test_a_probe_claim_returns_the_same_columns(kind, probed):
    assert columns(breaker_sql.claim_probe(kind, probed, True)) == claim_sql.CLAIMED
    assert columns(breaker_sql.claim_probe(kind, probed, False)) == claim_sql.LEASED
