"""`pgq show`, `pgq purge`, `pgq audit` and `pgq requeue --all --class` (issue 11).

Each command runs in-process through the CLI and through the plain function
behind it. Hostile values (ids, durations, limits, reasons, classes) must give
exit 2 with one line and write nothing; `purge` and `requeue` write exactly one
audit row each, in the same statement as their change; a purge deletes dead
rows only, and the group still drains, its frontier still advances and
retention still deletes messages afterwards.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

import pytest
from click.testing import Result
from helpers import (
    FAST,
    assert_usage_error,
    db_now,
    expire_all,
    invoke,
    kill,
    rows,
    set_rows,
    wait_for_frontier,
    wait_until,
)
from sqlalchemy import Engine, select, text, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.errors import DatabaseError, UsageError
from pgq.store import GroupStore, PurgeResult, purge, requeue

GROUP = "billing"
DEEP = '{"a":' * 5000 + "1" + "}" * 5000
HOSTILE = "a\x1b]0;owned\x07b\x1b[2J\u202ec\x9bd"
"""Text that would set the terminal's title, clear the screen and reverse the line."""


def publish(engine: Engine, n: int, topic: str = "orders") -> list[int]:
    return pgq.publish_many(engine, topic, [{"n": i} for i in range(n)])


def audit_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(t.audit).order_by(t.audit.c.id)).all()


def message_ids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(select(t.message.c.id)).scalars())


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def printable_lines(out: str) -> list[str]:
    """The lines of `out`, each checked to hold printable characters only."""
    lines = out.splitlines()
    for line in lines:
        assert line.isprintable(), repr(line)
    return lines


def refuse_audit_rows(engine: Engine, schema: str) -> None:
    """A trigger that makes every audit insert fail (to prove the change goes with it)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                f'CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql'
                " AS $$ BEGIN RAISE EXCEPTION 'audit refused'; END $$"
            )
        )
        conn.execute(
            text(
                f'CREATE TRIGGER refuse BEFORE INSERT ON "{schema}".audit'
                f' FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse()'
            )
        )


# --- pgq show ------------------------------------------------------------------------


def test_show_prints_one_message_in_full(orders, pgq_env):
    [mid, _] = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])
    with orders.begin() as conn:
        conn.execute(update(t.message).where(t.message.c.id == mid).values(key="k1",
                     headers={"h": 1}, dedupe_key="order-1"))  # fmt: skip
    expires = db_now(orders) + dt.timedelta(minutes=5)
    set_rows(orders, [mid], state="leased", attempts=2, reclaims=1, refundable_attempts=1,
             refundable_reclaims=1, refunds=1, error_class="systemic", last_error="boom",
             error_epoch=3, lease_owner="host:1:ab", lease_expires_at=expires)  # fmt: skip
    info = monitor.message(orders, GROUP, mid)
    assert info["message_id"] == mid and (info["group"], info["topic"]) == (GROUP, "orders")
    assert (info["payload"], info["headers"], info["key"]) == ({"n": 1}, {"h": 1}, "k1")
    assert info["dedupe_key"] == "order-1"
    assert info["state"] == "leased" and info["row"] == "present"
    assert (info["attempts"], info["reclaims"], info["refunds"]) == (2, 1, 1)
    assert (info["refundable_attempts"], info["refundable_reclaims"]) == (1, 1)
    assert (info["error_class"], info["error"], info["error_epoch"]) == ("systemic", "boom", 3)
    assert info["lease_owner"] == "host:1:ab"
    assert dt.datetime.fromisoformat(info["lease_expires_at"]) == expires
    for key in ("created_at", "available_at", "updated_at", "lease_expires_at"):
        assert info[key].endswith("+00:00")
    assert info["purge"] is None and info["unreadable"] is None

    assert json.loads(ok(invoke(pgq_env, "show", GROUP, str(mid), "--json"))) == info
    lines = printable_lines(ok(invoke(pgq_env, "show", GROUP, str(mid))))
    fields = dict(line.split(None, 1) for line in lines if not line.startswith("behind"))
    assert fields["state"] == "leased" and fields["error"] == "boom"
    assert fields["lease"] == f"host:1:ab until {info['lease_expires_at']}"
    assert fields["refundable"] == "attempts 1, reclaims 1"
    assert fields["payload"] == '{"n": 1}' and fields["headers"] == '{"h": 1}'
    assert fields["key"] == "k1" and fields["dedupe_key"] == "order-1"


def test_show_escapes_every_text_that_came_from_users(orders, pgq_env):
    [mid] = pgq.publish_many(orders, "orders", [{"text": HOSTILE}], headers={"h": HOSTILE})
    with orders.begin() as conn:
        conn.execute(
            update(t.message).where(t.message.c.id == mid).values(key=HOSTILE, dedupe_key=HOSTILE)
        )
    kill(orders, [mid], "message", last_error="Traceback\n  line 2\n" + HOSTILE,
         lease_owner=HOSTILE)  # fmt: skip
    out = ok(invoke(pgq_env, "show", GROUP, str(mid)))
    lines = printable_lines(out)
    assert len(lines) == 19  # one per field: no forged line
    assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out and "\\x9b" in out
    assert "Traceback\\n  line 2\\n" in out
    # JSON escapes them too, and keeps the exact values
    out = ok(invoke(pgq_env, "show", GROUP, str(mid), "--json"))
    assert out.isascii() and json.loads(out)["payload"] == {"text": HOSTILE}


def test_show_a_done_row_the_frontier_pruned(orders, pgq_env):
    ids = publish(orders, 3)
    summary = pgq.Consumer(orders, GROUP, lambda m: None, workers=1, **FAST).run(until_empty=True)
    assert summary.done == 3
    wait_for_frontier(orders, GROUP, ids[-1], advance=True)
    assert rows(orders, GROUP) == {}  # pruned
    info = monitor.message(orders, GROUP, ids[1])
    assert (info["state"], info["row"], info["behind_frontier"]) == ("done", "pruned", True)
    assert info["payload"] == {"n": 1}
    assert info["attempts"] is info["error"] is info["available_at"] is None
    assert info["dedupe_key"] is None
    out = ok(invoke(pgq_env, "show", GROUP, str(ids[1])))
    assert "state            done (row pruned behind the frontier" in out


def test_show_an_undecodable_payload_says_so(orders, schema, pgq_env):
    [mid] = publish(orders, 1)
    with orders.begin() as conn:
        conn.execute(
            text(f'UPDATE "{schema}".message SET payload = CAST(:p AS jsonb) WHERE id = :id'),
            {"p": DEEP, "id": mid},
        )
    info = monitor.message(orders, GROUP, mid)
    assert info["payload"] is None
    assert info["unreadable"] == "the stored message cannot be decoded: RecursionError"
    assert json.loads(ok(invoke(pgq_env, "show", GROUP, str(mid), "--json")))["payload"] is None
    out = ok(invoke(pgq_env, "show", GROUP, str(mid)))
    assert "payload          the stored message cannot be decoded: RecursionError" in out


def test_show_an_id_the_group_never_had_exits_2(orders, pgq_env):
    [mine] = publish(orders, 1)
    pgq.create_topic(orders, "other")
    pgq.subscribe(orders, "elsewhere", "other")
    [theirs] = publish(orders, 1, topic="other")
    pgq.subscribe(orders, "late", "orders", start="latest")  # never had `mine`
    for group, mid in ((GROUP, theirs), (GROUP, 999_999), ("late", mine)):
        result = invoke(pgq_env, "show", group, str(mid))
        assert_usage_error(result.exit_code, result.stderr, contains=f"has no message {mid}")
        with pytest.raises(UsageError):
            monitor.message(orders, group, mid)
    result = invoke(pgq_env, "show", "nosuch", str(mine))
    assert_usage_error(result.exit_code, result.stderr, contains="unknown group 'nosuch'")


@pytest.mark.parametrize(
    "value",
    ["0", "99999999999999999999", str(2**63), "1" * 5000, "abc", "1.5", "¹", "٣", "1e3", "", " "],
)
def test_show_refuses_a_bad_id_in_one_line(orders, pgq_env, value):
    publish(orders, 1)
    result = invoke(pgq_env, "show", GROUP, value)
    assert_usage_error(result.exit_code, result.stderr, contains="invalid message id")


def test_show_refuses_negative_ids_and_library_misuse(orders, pgq_env):
    result = invoke(pgq_env, "show", GROUP, "-5")
    assert_usage_error(result.exit_code, result.stderr)
    for bad in (0, -1, 2**63, True, "1"):
        with pytest.raises(UsageError, match="invalid message id"):
            monitor.message(orders, GROUP, bad)  # type: ignore[arg-type]


# --- pgq purge -----------------------------------------------------------------------


def mixed_rows(engine: Engine) -> dict[str, list[int]]:
    """Eight messages: two ready, one leased, two done and three dead (one per class)."""
    ids = publish(engine, 8)
    set_rows(engine, ids[2:3], state="leased", lease_owner="m", lease_expires_at=db_now(engine))
    set_rows(engine, ids[3:5], state="done")
    kill(engine, ids[5:6], "message")
    kill(engine, ids[6:7], "permanent")
    kill(engine, ids[7:8], "lease")
    return {"ready": ids[:2], "leased": ids[2:3], "done": ids[3:5], "dead": ids[5:]}


def test_purge_deletes_only_dead_rows_and_writes_one_audit_row(orders, pgq_env):
    kinds = mixed_rows(orders)
    before = rows(orders, GROUP)
    out = ok(invoke(pgq_env, "purge", GROUP, "--dead", "--reason", "poison messages"))
    assert out == "purged 3\n"
    after = rows(orders, GROUP)
    assert set(after) == set(before) - set(kinds["dead"])
    assert all(after[i] == before[i] for i in after)  # nothing else touched
    [a] = audit_rows(orders)
    assert (a.action, a.count, a.message_ids) == ("purge", 3, kinds["dead"])
    assert a.reason == "poison messages" and "@" in a.actor
    counts = pgq.status(orders, GROUP)["counts"]
    assert (counts["dead"], counts["ready"], counts["leased"]) == (0, 2, 1)
    assert message_ids(orders) >= set(kinds["dead"])  # the messages are retention's to delete


def test_purge_older_than_counts_from_the_last_change_by_the_database_clock(orders, pgq_env):
    ids = publish(orders, 4)
    now = db_now(orders)
    kill(orders, ids[:2], "message", updated_at=now - dt.timedelta(days=10))
    kill(orders, ids[2:3], "permanent", updated_at=now - dt.timedelta(hours=1))
    kill(orders, ids[3:4], "lease", updated_at=now + dt.timedelta(hours=1))
    args = ("purge", GROUP, "--dead", "--reason", "old")
    assert ok(invoke(pgq_env, *args, "--older-than", "7d")) == "purged 2\n"
    assert ok(invoke(pgq_env, *args, "--older-than", "12h")) == "purged 0\n"
    assert ok(invoke(pgq_env, *args, "--older-than", "30m")) == "purged 1\n"
    assert set(rows(orders, GROUP)) == {ids[3]}
    nothing = purge(orders, GROUP, older_than=90, reason="x")
    assert (nothing.count, nothing.audit_id) == (0, None)
    # a purge that deleted nothing leaves no audit row (issue 21)
    assert [(a.count, a.message_ids) for a in audit_rows(orders)] == [(2, ids[:2]), (1, [ids[2]])]


def test_purge_keeps_the_rows_a_reconciliation_will_bring_back(orders, pgq_env):
    ids = publish(orders, 4)
    with orders.begin() as conn:
        conn.execute(update(t.breaker).values(state="OPEN", epoch=1))
    kill(orders, ids[:2], "systemic", error_epoch=0, refunds=0)  # the outage's: pending
    kill(orders, ids[2:3], "systemic", refunds=3)  # past the refund cap: a dead letter
    kill(orders, ids[3:4], "message")
    out = ok(invoke(pgq_env, "purge", GROUP, "--dead", "--reason", "clean up"))
    assert out == "purged 2, kept 2 pending reconciliation\n"
    assert set(rows(orders, GROUP)) == set(ids[:2])
    [a] = audit_rows(orders)
    assert (a.count, a.message_ids) == (2, ids[2:])
    # the cap comes from the settings, as in `pgq check`
    result = purge(orders, GROUP, reason="again", max_refunds=0)
    assert (result.count, result.kept) == (2, 0)


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["--reason", "x"], "give --dead"),
        (["--dead"], "--reason is required"),
        (["--dead", "--reason", " \t "], "--reason is required"),
        (["--dead", "--reason", "x", "--older-than", "abc"], "invalid --older-than 'abc'"),
        (["--dead", "--reason", "x", "--older-than", "-1"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "-7d"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "1e300"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "101000d"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "nan"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "inf"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "7x"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "5m1h"], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", ""], "invalid --older-than"),
        (["--dead", "--reason", "x", "--older-than", "\x1b[2J"], "invalid --older-than"),
        (["--dead", "--reason", "a\x00b"], "without NUL bytes or lone surrogates"),
        (["--dead", "--reason", "a\udc80b"], "without NUL bytes or lone surrogates"),
    ],
)
def test_bad_purge_usage_is_one_line_exit_2_and_writes_nothing(orders, pgq_env, args, contains):
    ids = publish(orders, 2)
    kill(orders, ids, "message", updated_at=db_now(orders) - dt.timedelta(days=365))
    before = rows(orders, GROUP)
    result = invoke(pgq_env, "purge", GROUP, *args)
    assert_usage_error(result.exit_code, result.stderr, contains=contains)
    assert printable_lines(result.stderr)
    assert rows(orders, GROUP) == before
    assert audit_rows(orders) == []


def test_purge_unknown_group_and_library_argument_checks(orders, pgq_env):
    result = invoke(pgq_env, "purge", "nosuch", "--dead", "--reason", "x")
    assert_usage_error(result.exit_code, result.stderr, contains="unknown group 'nosuch'")
    for age in (-1, float("nan"), float("inf"), 1e300, True, "7d"):
        with pytest.raises(UsageError, match="invalid age"):
            purge(orders, GROUP, older_than=age, reason="x")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="non-empty reason"):
        purge(orders, GROUP, reason="  ")
    assert audit_rows(orders) == []


def test_a_purge_whose_audit_row_fails_deletes_nothing(orders, schema, pgq_env):
    ids = publish(orders, 3)
    kill(orders, ids, "permanent")
    before = rows(orders, GROUP)
    refuse_audit_rows(orders, schema)
    with pytest.raises(DatabaseError, match="audit refused"):
        purge(orders, GROUP, reason="x")
    result = invoke(pgq_env, "purge", GROUP, "--dead", "--reason", "x")
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "audit refused" in result.stderr and "Traceback" not in result.stderr
    assert rows(orders, GROUP) == before
    # the same holds for requeue
    with pytest.raises(DatabaseError, match="audit refused"):
        requeue(orders, GROUP, all_dead=True, reason="x")
    with pytest.raises(DatabaseError, match="audit refused"):
        requeue(orders, GROUP, all_dead=True, error_class="permanent", reason="x")
    assert rows(orders, GROUP) == before
    assert audit_rows(orders) == []


def test_a_dead_row_changed_during_a_purge_is_left_alone(orders):
    """A row requeued while the purge waits for it is rechecked and not deleted; the
    audit row lists exactly the rows that were."""
    ids = publish(orders, 3)
    kill(orders, ids, "message")
    outcome: list[BaseException | PurgeResult] = []
    with orders.connect() as conn:
        conn.begin()
        conn.execute(update(t.delivery).where(t.delivery.c.message_id == ids[1])
                     .values(state="ready", error_class=None))  # fmt: skip

        def run() -> None:
            try:
                outcome.append(purge(orders, GROUP, reason="x"))
            except BaseException as exc:
                outcome.append(exc)

        worker = threading.Thread(target=run, name="purge")
        worker.start()
        wait_until(lambda: purge_waits(orders) or outcome, 30, "the purge to wait for the row")
        conn.commit()
    worker.join(30)
    assert not worker.is_alive()
    [result] = outcome
    assert isinstance(result, PurgeResult) and result.count == 2, result
    after = rows(orders, GROUP)
    assert ids[1] in after and after[ids[1]].state == "ready"
    assert ids[0] not in after and ids[2] not in after
    [audit] = audit_rows(orders)
    assert audit.count == 2 and sorted(audit.message_ids) == [ids[0], ids[2]]


def waits_on_lock(engine: Engine, query: str) -> bool:
    """A session of this database running a statement like `query` waits for a lock."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE :query"
                ),
                {"query": query},
            ).scalar()
        )


def purge_waits(engine: Engine) -> bool:
    return waits_on_lock(engine, "%DELETE FROM%audit%")


def test_after_a_purge_the_group_drains_the_frontier_passes_and_retention_deletes(orders, pgq_env):
    """The purged rows are a gap in the group's rows: the frontier passes it like
    the gaps pruning leaves, and retention deletes the purged messages with the
    others. The first message waits (not claimable), so the purge happens ahead
    of the frontier."""
    [first] = pgq.publish_many(orders, "orders", [{"n": -1}], delay=3600)
    ids = publish(orders, 6)
    doomed = {ids[1], ids[4], ids[5]}  # the last rows too: nothing after them

    def handle(msg: pgq.Message) -> None:
        if msg.id in doomed:
            raise pgq.PermanentError("poison")

    summary = pgq.Consumer(orders, GROUP, handle, workers=2, **FAST).run(until_empty=True)
    assert (summary.done, summary.dead) == (3, 3)
    assert pgq.status(orders, GROUP)["committed"] is None  # held by the waiting first row
    assert ok(invoke(pgq_env, "purge", GROUP, "--dead", "--reason", "poison")) == "purged 3\n"
    purged = monitor.message(orders, GROUP, ids[1])
    assert (purged["state"], purged["row"]) == ("purged", "purged")
    assert purged["purge"]["reason"] == "poison" and purged["attempts"] is None
    out = ok(invoke(pgq_env, "show", GROUP, str(ids[4])))
    assert "state            purged (audit " in out and ": poison)" in out

    set_rows(orders, [first], available_at=db_now(orders))
    more = publish(orders, 2)
    summary = pgq.Consumer(orders, GROUP, handle, workers=2, **FAST).run(until_empty=True)
    assert (summary.done, summary.dead, summary.stop_reason) == (3, 0, "empty")
    wait_for_frontier(orders, GROUP, more[-1], advance=True)
    status = pgq.status(orders, GROUP)
    assert status["counts"] == {"ready": 0, "leased": 0, "done": 6, "dead": 0, "dead_systemic": 0}
    assert rows(orders, GROUP) == {}  # every done row pruned

    assert expire_all(orders) == 9
    assert message_ids(orders) == set()
    result = invoke(pgq_env, "show", GROUP, str(ids[1]))
    assert_usage_error(result.exit_code, result.stderr, contains="has no message")


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
    # the requeue that matched nothing left no audit row (issue 21)
    assert [(a.action, a.count, a.message_ids) for a in audit_rows(orders)] == [
        ("requeue", 2, ids[:2]),
        ("requeue", 1, [ids[3]]),
        ("requeue", 1, [ids[4]]),
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


# --- pgq audit -----------------------------------------------------------------------


def test_audit_lists_requeues_and_purges_newest_first(orders, pgq_env):
    ids = publish(orders, 4)
    kill(orders, ids, "message")
    requeue(orders, GROUP, [ids[0]], reason="first", actor="ops@a")
    purge(orders, GROUP, reason=HOSTILE, actor="ops@b")
    trail = monitor.audit(orders, GROUP)
    assert [(a["action"], a["count"], a["message_ids"], a["actor"]) for a in trail] == [
        ("purge", 3, ids[1:], "ops@b"),
        ("requeue", 1, [ids[0]], "ops@a"),
    ]
    assert trail[0]["reason"] == " ".join(HOSTILE.split())
    assert trail[0]["id"] > trail[1]["id"] and trail[0]["at"].endswith("+00:00")
    assert json.loads(ok(invoke(pgq_env, "audit", GROUP, "--json"))) == trail
    assert json.loads(ok(invoke(pgq_env, "audit", GROUP, "--json", "--limit", "1"))) == trail[:1]
    assert monitor.audit(orders, GROUP, 0) == []
    lines = printable_lines(ok(invoke(pgq_env, "audit", GROUP)))
    assert len(lines) == 3 and lines[0].split() == [
        "ID", "AT", "ACTION", "COUNT", "ACTOR", "ROLE", "MESSAGE_IDS", "REASON"
    ]  # fmt: skip
    with orders.connect() as conn:  # the role is the session's
        assert trail[0]["role"] == trail[1]["role"] == conn.scalar(text("SELECT current_user"))
    assert "\\x1b]0;owned\\x07" in lines[1] and "\\u202e" in lines[1]
    assert f"{ids[1]},{ids[2]},{ids[3]}" in lines[1]


def test_audit_of_a_quiet_group_and_hostile_limits(orders, pgq_env):
    assert ok(invoke(pgq_env, "audit", GROUP)) == "no audit rows\n"
    assert ok(invoke(pgq_env, "audit", GROUP, "--json")) == "[]\n"
    for limit in ("-1", "1e20", str(2**63), str(2**31), "abc", ""):
        result = invoke(pgq_env, "audit", GROUP, "--limit", limit)
        assert_usage_error(result.exit_code, result.stderr, contains="--limit")
    result = invoke(pgq_env, "audit", "nosuch")
    assert_usage_error(result.exit_code, result.stderr, contains="unknown group 'nosuch'")
    for limit in (-1, 2**31, True):
        with pytest.raises(UsageError, match="invalid limit"):
            monitor.audit(orders, GROUP, limit)


def test_a_breaker_that_opens_during_a_purge_keeps_the_rows_it_will_refund(orders):
    """Found by an attack; failed on a50f3e3: the purge read CLOSED (nothing pending),
    the quorum opened the group before its delete, and it deleted the dead systemic
    rows the coming close owes a refund: messages lost. An open now takes the
    group's breaker-flip lock, which a purge takes shared before it reads."""
    from pgq.store import group_info, member_lock

    ids = publish(orders, 3)
    kill(orders, ids, "systemic")  # an outage under way: three deaths so far, CLOSED
    gid = group_info(orders, GROUP).id
    locks, stores = [], []
    try:
        for name in ("a", "b"):  # two live members whose local breakers tripped
            lock = member_lock(orders, gid, name)
            assert lock.acquire()
            locks.append(lock)
            store = GroupStore(gid, GROUP, "orders", name, 600.0, 3)
            with orders.begin() as conn:
                assert store.join(conn, 600.0, True)
                store.heartbeat(conn, "open", 0)
            stores.append(store)
        outcome: list[BaseException | PurgeResult] = []
        with orders.connect() as conn, conn.begin():  # the open, not committed yet
            opened = stores[0].open_on_quorum(conn, 0, ttl=600.0, min_members=2, quorum=0.5)
            assert opened == 1

            def run() -> None:
                try:
                    outcome.append(purge(orders, GROUP, reason="cleanup"))
                except BaseException as exc:
                    outcome.append(exc)

            worker = threading.Thread(target=run, name="purge")
            worker.start()
            wait_until(lambda: flip_waits(orders) or outcome, 30, "the purge to wait")
        worker.join(30)
        [result] = outcome
        assert isinstance(result, PurgeResult), result
        assert (result.count, result.kept) == (0, 3)
        assert all(rows(orders, GROUP)[i].state == "dead" for i in ids)
    finally:
        for lock in locks:
            lock.release()


def flip_waits(engine: Engine) -> bool:
    """A session waits for the breaker-flip lock (a purge behind an open)."""
    return waits_on_lock(engine, "%advisory_xact_lock_shared%")
