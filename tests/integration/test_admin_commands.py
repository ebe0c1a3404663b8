"""Hostile input to `pgq requeue` (issue 11 #3).

Each command runs in-process through the CLI and through the plain function
behind it. Hostile ids and reasons must give exit 2 with one line and write
nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import (
    assert_usage_error,
    invoke,
    rows,
)
from sqlalchemy import Engine, select, update

import pgq
from pgq import schema as t
from pgq.errors import UsageError
from pgq.store import requeue

GROUP = "billing"


def publish(engine: Engine, n: int, topic: str = "orders") -> list[int]:
    return pgq.publish_many(engine, topic, [{"n": i} for i in range(n)])


def set_rows(engine: Engine, ids: list[int], **values: Any) -> None:
    d = t.delivery
    with engine.begin() as conn:
        conn.execute(update(d).where(d.c.message_id.in_(ids)).values(**values))


def kill(engine: Engine, ids: list[int], error_class: str, **values: Any) -> None:
    """Make rows dead the way the consumer would (attempts used up, an error kept)."""
    fields = {
        "state": "dead",
        "attempts": 3,
        "error_class": error_class,
        "last_error": f"{error_class} failure",
        "error_epoch": 0,
        "refundable_attempts": 3 if error_class == "systemic" else 0,
        **values,
    }
    set_rows(engine, ids, **fields)


def audit_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(t.audit).order_by(t.audit.c.id)).all()


# --- pgq requeue: hostile ids and reasons -------------------------------------------


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["--id", "99999999999999999999"], "invalid message id"),
        (["--id", "¹"], "invalid message id"),
        (["--id", "٣"], "invalid message id"),
        (["--id", "-3"], "invalid message id"),
        (["--id", "{id},,{id}"], "invalid message id"),
        (["--all", "--reason", "a\udc80b"], "without NUL bytes or lone surrogates"),
        (["--id", "{id}", "--reason", "\x00"], "without NUL bytes or lone surrogates"),
    ],
)
def test_bad_requeue_values_are_one_line_exit_2_and_write_nothing(orders, pgq_env, args,
                                                                   contains):  # fmt: skip
    ids = publish(orders, 1)
    kill(orders, ids, "message")
    before = rows(orders, GROUP)
    args = [a.format(id=ids[0]) for a in args]
    if "--reason" not in args:
        args.extend(["--reason", "x"])
    result = invoke(pgq_env, "requeue", GROUP, *args)
    assert_usage_error(result.exit_code, result.stderr, contains=contains)
    assert rows(orders, GROUP) == before
    assert audit_rows(orders) == []


def test_requeue_library_checks_ids_and_reasons(orders):
    with pytest.raises(UsageError, match="without NUL bytes"):
        requeue(orders, GROUP, all_dead=True, reason="a\udc80")
    with pytest.raises(UsageError, match="invalid message id"):
        requeue(orders, GROUP, [2**63], reason="x")
    assert audit_rows(orders) == []
