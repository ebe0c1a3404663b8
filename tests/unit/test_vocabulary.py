"""One vocabulary (issue 20): the words pgq stores and shows, spelled once in
`pgq.records`, are their plain strings wherever they go, and the DDL built from
them is byte for byte the released one."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from sqlalchemy import CheckConstraint

from pgq import breaker, classify, schema
from pgq.records import BreakerState, ErrorClass, LocalBreakerState, OutcomeKind, RowState

WORDS = [*BreakerState, *LocalBreakerState, *RowState, *ErrorClass, *OutcomeKind]


@pytest.mark.parametrize("word", WORDS, ids=lambda w: f"{type(w).__name__}.{w.name}")
def test_a_word_is_its_plain_string(word):
    plain = word.value
    assert type(plain) is str
    assert word == plain and hash(word) == hash(plain)
    assert str(word) == f"{word}" == format(word) == plain
    assert json.dumps({"w": word}) == json.dumps({"w": plain})


def test_the_words_are_the_released_ones():
    assert [*BreakerState] == ["CLOSED", "OPEN"]
    assert [*LocalBreakerState] == ["open", "closed"]
    assert [*RowState] == ["ready", "leased", "done", "dead"]
    assert [*ErrorClass] == ["systemic", "message", "permanent", "lease"]
    assert [*OutcomeKind] == ["done", "retry", "dead", "snooze"]


def test_the_typed_literals_agree_with_the_enums():
    assert set(get_args(breaker.BreakerState)) == {s.value for s in LocalBreakerState}
    assert set(get_args(classify.Classification)) == {
        c.value for c in ErrorClass if c is not ErrorClass.LEASE
    }
    assert classify.CLASSIFICATIONS == set(get_args(classify.Classification))
    assert breaker.LocalBreaker().state in set(LocalBreakerState)


def test_the_schema_tuples_are_plain_strings():
    # click.Choice reads enum members by their names: these must stay plain
    assert schema.STATES == ("ready", "leased", "done", "dead")
    assert schema.ERROR_CLASSES == ("systemic", "message", "permanent", "lease")
    assert all(type(w) is str for w in (*schema.STATES, *schema.ERROR_CLASSES))


def _checks(table):
    return {c.name: str(c.sqltext) for c in table.constraints if isinstance(c, CheckConstraint)}


def test_the_check_constraints_are_the_released_ones():
    assert _checks(schema.delivery) == {
        "delivery_state_check": "state IN ('ready', 'leased', 'done', 'dead')",
        "delivery_error_class_check": (
            "error_class IS NULL OR error_class IN ('systemic', 'message', 'permanent', 'lease')"
        ),
    }
    assert _checks(schema.member) == {
        "member_local_breaker_check": "local_breaker IN ('open', 'closed')"
    }
    assert _checks(schema.breaker) == {"breaker_state_check": "state IN ('CLOSED', 'OPEN')"}
    assert _checks(schema.probe)["probe_error_class_check"] == (
        "error_class IS NULL OR error_class IN ('systemic', 'message', 'permanent')"
    )


def test_the_defaults_are_the_released_ones():
    def default(column):
        return str(column.server_default.arg)

    assert default(schema.delivery.c.state) == "'ready'"
    assert default(schema.member.c.local_breaker) == "'closed'"
    assert default(schema.breaker.c.state) == "'CLOSED'"
