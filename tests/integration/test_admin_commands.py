"""`pgq requeue --all --class` and hostile requeue input (issue 11).

Each command runs in-process through the CLI and through the plain function
behind it. Hostile values (ids, reasons, classes) must give exit 2 with one
line and write nothing; a requeue writes exactly one audit row.
"""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import Result
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


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


# --- pgq requeue --all --class -------------------------------------------------------


def test_requeue_all_of_one_class(orders, pgq_env):
    ids = publish(orders, 5)
    kill(orders, ids[:2], "message")
    kill(orders, ids[2:3], "permanent")
    kill(orders, ids[3:4], "systemic", refunds=3)
    kill(orders, ids[4:5], "lease")
    args = ("requeue", GROUP, "--all", "--reason", "parser fixed", "--class")
    assert ok(invoke(pgq_env, *args, "message")) == "requeued 2\n"
    after = rows(orders, GROUP)
    assert [after[i].state for i in ids] == ["ready", "ready", "dead", "dead", "dead"]
    assert ok(invoke(pgq_env, *args, "systemic")) == "requeued 1\n"
    assert requeue(orders, GROUP, all_dead=True, error_class="lease", reason="x").count == 1
    assert ok(invoke(pgq_env, *args, "message")) == "requeued 0\n"
    assert [(a.action, a.count, a.message_ids) for a in audit_rows(orders)] == [
        ("requeue", 2, ids[:2]),
        ("requeue", 1, [ids[3]]),
        ("requeue", 1, [ids[4]]),
        ("requeue", 0, []),
    ]
    assert rows(orders, GROUP)[ids[2]].state == "dead"


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["--all", "--class", "bogus"], "Invalid value for '--class'"),
        (["--all", "--class", "Message"], "Invalid value for '--class'"),
        (["--all", "--class", ""], "Invalid value for '--class'"),
        (["--id", "{id}", "--class", "message"], "--class goes with --all"),
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


def test_requeue_class_library_checks(orders):
    with pytest.raises(UsageError, match="invalid error class 'bogus'"):
        requeue(orders, GROUP, all_dead=True, error_class="bogus", reason="x")
    with pytest.raises(UsageError, match="use it with all_dead"):
        requeue(orders, GROUP, [1], error_class="message", reason="x")
    with pytest.raises(UsageError, match="invalid message id"):
        requeue(orders, GROUP, [2**63], reason="x")
    assert audit_rows(orders) == []
