"""`pgq check` (Nagios states and exit codes) and `pgq requeue` (audited requeue of dead rows)."""

from __future__ import annotations

import datetime as dt
import subprocess
from typing import Any

import pytest
from click.testing import CliRunner, Result
from helpers import FAST, PGQ, db_now, invoke, kill, rows, set_rows
from sqlalchemy import Engine, select, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.cli import cli
from pgq.errors import UnknownGroup, UsageError
from pgq.store import requeue

GROUP = "billing"


@pytest.fixture
def billing(orders: Engine) -> Engine:
    """The shared `orders` fixture (topic `orders`, group `billing`), named for the group."""
    return orders


def publish(engine: Engine, n: int) -> list[int]:
    return pgq.publish_many(engine, "orders", [{"n": i} for i in range(n)])


def set_breaker(engine: Engine, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(update(t.breaker).values(**values))


def audit_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(t.audit).order_by(t.audit.c.id)).all()


# --- check: the verdicts ------------------------------------------------------------


def test_ok_with_a_short_summary(billing, pgq_env):
    ids = publish(billing, 4)
    set_rows(billing, ids[:3], state="done")
    word, line = monitor.check(billing, GROUP)
    assert word == "OK"
    assert line.startswith("OK: breaker CLOSED (epoch 0)")
    assert "lag 1" in line and "no dead rows" in line
    result = invoke(pgq_env, "check", GROUP)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [line]


def test_open_breaker_is_a_warning_even_with_no_dead_rows(billing, pgq_env):
    publish(billing, 3)
    set_breaker(billing, state="OPEN", epoch=1)
    assert monitor.check(billing, GROUP) == (
        "WARNING",
        "WARNING: breaker open, 0 dead rows pending reconciliation",
    )
    result = invoke(pgq_env, "check", GROUP)
    assert result.exit_code == 1
    assert result.stdout == "WARNING: breaker open, 0 dead rows pending reconciliation\n"


def test_open_breaker_counts_the_dead_systemic_rows_a_close_will_refund(billing, pgq_env):
    ids = publish(billing, 6)
    set_breaker(billing, state="OPEN", epoch=1)
    kill(billing, ids[:2], "systemic", error_epoch=0, refunds=0)
    kill(billing, ids[2:4], "systemic", error_epoch=1, refunds=2)  # below the cap of 3
    result = invoke(pgq_env, "check", GROUP)
    assert result.exit_code == 1
    assert result.stdout == "WARNING: breaker open, 4 dead rows pending reconciliation\n"


def test_real_dead_letters_are_critical_and_win_over_the_open_breaker(billing, pgq_env):
    ids = publish(billing, 6)
    set_breaker(billing, state="OPEN", epoch=1)
    kill(billing, ids[:2], "systemic")
    kill(billing, ids[2:3], "message")
    kill(billing, ids[3:4], "permanent")
    kill(billing, ids[4:5], "lease")
    word, line = monitor.check(billing, GROUP)
    assert word == "CRITICAL"
    assert line == (
        "CRITICAL: 3 dead rows (1 message, 1 permanent, 1 lease);"
        " breaker open, 2 dead rows pending reconciliation"
    )
    result = invoke(pgq_env, "check", GROUP)
    assert result.exit_code == 2
    assert result.stdout == line + "\n"


def test_rows_past_the_refund_cap_are_critical(billing, pgq_env):
    ids = publish(billing, 3)
    set_breaker(billing, state="OPEN", epoch=1)
    kill(billing, ids[:1], "systemic", refunds=3)
    kill(billing, ids[1:2], "systemic", refunds=0)
    result = invoke(pgq_env, "check", GROUP)
    assert result.exit_code == 2
    assert result.stdout == (
        "CRITICAL: 1 dead rows (1 systemic, refund cap reached);"
        " breaker open, 1 dead rows pending reconciliation\n"
    )
    # the cap comes from the settings (breaker.max_refunds)
    result = invoke(pgq_env, "check", GROUP, PGQ_BREAKER_MAX_REFUNDS="5")
    assert result.exit_code == 1
    assert result.stdout == "WARNING: breaker open, 2 dead rows pending reconciliation\n"


def test_closed_group_dead_systemic_rows_are_real_unless_a_reconciliation_is_owed(billing):
    ids = publish(billing, 3)
    kill(billing, ids[:2], "systemic", error_epoch=0)
    # closed, nothing owed: a lone bad node's deaths are never refunded
    word, line = monitor.check(billing, GROUP)
    assert word == "CRITICAL"
    assert line == "CRITICAL: 2 dead rows (2 systemic, not owed a refund)"
    # closed at epoch 2 after an outage opened at 1: refunds owed for epochs [0, 2),
    # to the dead rows and to a ready one waiting for its systemic retry
    set_rows(billing, ids[2:], error_class="systemic", refundable_attempts=1, error_epoch=1)
    set_breaker(billing, state="CLOSED", epoch=2, reconcile_epoch=2, reconcile_from_epoch=0)
    assert monitor.check(billing, GROUP) == (
        "WARNING",
        "WARNING: reconciliation in progress, 3 rows to refund",
    )
    # the reconciliation finished
    set_breaker(billing, reconcile_epoch=None, reconcile_from_epoch=None)
    assert monitor.check(billing, GROUP)[0] == "CRITICAL"


def test_an_old_outage_rows_are_not_pending_for_a_new_one(billing):
    ids = publish(billing, 3)
    # open at epoch 5: its close refunds failures from epoch 4 on, not epoch 1's
    set_breaker(billing, state="OPEN", epoch=5)
    kill(billing, ids[:1], "systemic", error_epoch=1)
    kill(billing, ids[1:2], "systemic", error_epoch=4)
    assert monitor.check(billing, GROUP) == (
        "CRITICAL",
        "CRITICAL: 1 dead rows (1 systemic, not owed a refund);"
        " breaker open, 1 dead rows pending reconciliation",
    )


@pytest.mark.parametrize(
    ("state", "epoch", "owed", "expected"),
    [
        ("CLOSED", 0, (None, None), None),
        ("OPEN", 1, (None, None), (0, 2)),
        ("OPEN", 5, (4, 2), (2, 6)),  # reopened before the last reconciliation finished
        ("CLOSED", 4, (4, 2), (2, 4)),
    ],
)
def test_pending_scope_mirrors_close_and_reconcile(state, epoch, owed, expected):
    assert monitor.pending_scope(state, epoch, *owed) == expected


# --- check: UNKNOWN ------------------------------------------------------------------


def test_unknown_group_and_missing_schema_are_unknown_exit_3(billing, pgq_env):
    result = invoke(pgq_env, "check", "nosuch")
    assert result.exit_code == 3
    assert result.stdout == "UNKNOWN: unknown group 'nosuch'\n"
    result = invoke(pgq_env, "check", "bad name!")
    assert result.exit_code == 3 and result.stdout.startswith("UNKNOWN: invalid group name")
    result = invoke(pgq_env, "check")
    assert result.exit_code == 3 and result.stdout.startswith("UNKNOWN: usage: Missing argument")
    result = CliRunner().invoke(
        cli, ["check", GROUP], env={"PGQ_DSN": pgq_env["PGQ_DSN"], "PGQ_SCHEMA": "pgq_nothing"}
    )
    assert result.exit_code == 3
    assert result.stdout.startswith("UNKNOWN: The pgq schema is not installed")
    with pytest.raises(UnknownGroup):
        monitor.check(billing, "nosuch")


def test_unreachable_server_and_bad_dsn_are_unknown_exit_3_in_a_real_process(pgq_env):
    env = {**pgq_env, "PGQ_DSN": "postgresql://nobody@127.0.0.1:1/nothing"}
    proc = subprocess.run(
        [*PGQ, "check", GROUP], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc
    assert proc.stdout.startswith("UNKNOWN: cannot reach the database")
    assert len(proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [*PGQ, "--dsn", "host=localhost port", "check", GROUP],
        env=pgq_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc
    assert proc.stdout.startswith("UNKNOWN: invalid database address")


def test_warning_exit_1_in_a_real_process(billing, pgq_env):
    set_breaker(billing, state="OPEN", epoch=1)
    proc = subprocess.run(
        [*PGQ, "check", GROUP], env=pgq_env, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (
        1,
        "WARNING: breaker open, 0 dead rows pending reconciliation\n",
    )


# --- requeue -----------------------------------------------------------------------


def assert_one_line_exit_2(result: Result, contains: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgq: error: "), result.stderr
    assert contains in lines[0], lines[0]


def test_requeue_by_id_resets_the_row_and_writes_one_audit_row(billing, pgq_env):
    ids = publish(billing, 4)
    future = db_now(billing) + dt.timedelta(hours=1)
    kill(
        billing,
        ids[:3],
        "message",
        reclaims=2,
        refundable_attempts=1,
        refundable_reclaims=1,
        refunds=1,
        available_at=future,
    )
    result = invoke(pgq_env, "requeue", GROUP, "--id", str(ids[0]), "--id", str(ids[1]),
                    "--reason", "fixed the parser")  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout == "requeued 2\n"
    now = db_now(billing)
    after = rows(billing, GROUP)
    for mid in ids[:2]:
        r = after[mid]
        assert r.state == "ready" and r.available_at <= now
        assert (r.attempts, r.reclaims, r.refundable_attempts, r.refundable_reclaims) == (0,) * 4
        assert r.error_class is None and r.lease_owner is None
        assert r.last_error == "message failure"  # kept for whoever looks next
        assert r.refunds == 1  # unchanged: requeue is not a refund
    assert after[ids[2]].state == "dead"  # not named
    [a] = audit_rows(billing)
    assert a.action == "requeue" and a.count == 2
    assert a.message_ids == ids[:2]
    assert a.reason == "fixed the parser"
    assert "@" in a.actor
    assert pgq.status(billing, GROUP)["counts"]["dead"] == 1


def test_requeue_all_and_comma_separated_ids(billing, pgq_env):
    ids = publish(billing, 6)
    kill(billing, ids[:4], "systemic", refunds=3)
    kill(billing, ids[4:5], "permanent")
    result = invoke(pgq_env, "requeue", GROUP, "--id", f"{ids[0]},{ids[1]}", "--reason", "x")
    assert result.stdout == "requeued 2\n"
    result = invoke(pgq_env, "requeue", GROUP, "--all", "--reason", "dependency fixed")
    assert result.exit_code == 0 and result.stdout == "requeued 3\n"
    assert all(r.state == "ready" for r in rows(billing, GROUP).values())
    first, second = audit_rows(billing)
    assert (first.message_ids, first.count) == (ids[:2], 2)
    assert (second.message_ids, second.count, second.reason) == (ids[2:5], 3, "dependency fixed")
    # nothing dead left: a requeue of nothing writes no audit row (issue 21)
    result = invoke(pgq_env, "requeue", GROUP, "--all", "--reason", "again")
    assert result.stdout == "requeued 0\n"
    assert len(audit_rows(billing)) == 2


def test_requeue_all_lists_a_bounded_number_of_ids_and_the_full_count(billing):
    ids = publish(billing, 30)
    kill(billing, ids, "message")
    result = requeue(billing, GROUP, all_dead=True, reason="bulk", actor="ops@host", max_listed=5)
    assert result.count == 30
    [a] = audit_rows(billing)
    assert (a.id, a.count, a.actor) == (result.audit_id, 30, "ops@host")
    assert a.message_ids == ids[:5]


def test_an_invalid_id_writes_nothing(billing, pgq_env):
    ids = publish(billing, 4)
    kill(billing, ids[:1], "message")
    set_rows(billing, ids[1:2], state="done")
    before = rows(billing, GROUP)
    result = invoke(pgq_env, "requeue", GROUP, "--id", str(ids[0]), "--id", str(ids[1]),
                    "--id", "999999", "--reason", "oops")  # fmt: skip
    assert_one_line_exit_2(result, f"not dead: {ids[1]}, 999999")
    assert rows(billing, GROUP) == before
    assert audit_rows(billing) == []


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["--id", "1"], "--reason is required"),
        (["--id", "1", "--reason", "   "], "--reason is required"),
        (["--all", "--id", "1", "--reason", "x"], "mutually exclusive"),
        (["--reason", "x"], "--id ID ... or --all"),
        (["--id", "abc", "--reason", "x"], "invalid message id 'abc'"),
        (["--id", "0", "--reason", "x"], "invalid message id '0'"),
    ],
)
def test_bad_requeue_usage_is_one_line_exit_2(billing, pgq_env, args, contains):
    ids = publish(billing, 1)
    kill(billing, ids, "message")
    assert_one_line_exit_2(invoke(pgq_env, "requeue", GROUP, *args), contains)
    assert audit_rows(billing) == []
    assert rows(billing, GROUP)[ids[0]].state == "dead"


def test_requeue_unknown_group_and_library_argument_checks(billing, pgq_env):
    assert_one_line_exit_2(
        invoke(pgq_env, "requeue", "nosuch", "--all", "--reason", "x"), "unknown group"
    )
    with pytest.raises(UsageError):
        requeue(billing, GROUP, [1], all_dead=True, reason="x")
    with pytest.raises(UsageError):
        requeue(billing, GROUP, reason="x")
    with pytest.raises(UsageError):
        requeue(billing, GROUP, all_dead=True, reason=" ")


def test_a_requeued_row_is_consumed_again(billing):
    ids = publish(billing, 3)
    kill(billing, ids, "message")
    requeue(billing, GROUP, [ids[1]], reason="retry one")
    seen: list[int] = []
    consumer = pgq.Consumer(billing, GROUP, lambda m: seen.append(m.id), workers=1, **FAST)
    summary = consumer.run(until_empty=True)
    assert (seen, summary.done) == ([ids[1]], 1)
    counts = pgq.status(billing, GROUP)["counts"]  # the done row may be pruned already
    assert (counts["done"], counts["dead"], counts["ready"]) == (1, 2, 0)
    after = rows(billing, GROUP)
    assert after[ids[0]].state == after[ids[2]].state == "dead"


def test_requeue_all_of_many_rows_lists_at_most_10000_ids(billing, pgq_env):
    ids = publish(billing, 20_000)
    kill(billing, ids, "systemic", refunds=3)
    result = invoke(pgq_env, "requeue", GROUP, "--all", "--reason", "after the incident")
    assert result.stdout == "requeued 20000\n"
    [a] = audit_rows(billing)
    assert a.count == 20_000
    assert a.message_ids == ids[:10_000]
    assert pgq.status(billing, GROUP)["counts"]["ready"] == 20_000
