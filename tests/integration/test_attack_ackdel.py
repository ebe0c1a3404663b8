"""Attacks on the ack that deletes what it finishes (schema version 6, decision 0037).

Each test here failed on the branch `ackdel` (7d4495d) when it was written: a defect
found with real processes, written down as the smallest reproduction.

- An earlier (version 5) member forgets a departed member of today's version with
  its own statement, which deletes the member row without folding `done_total`
  into `done_pruned`: the group's done count drops by what that member finished.
  Found with real processes (`pgq consume` of c622049 started after a v6 member ran
  `--until-empty` on the same group: done 2000 -> 1732).
- An ack by a member whose row is gone (forgotten while its session was lost and
  it held no lease, then it claimed again) deletes the rows and counts them
  nowhere.
- `pgq show` of a finished message a group got from `--from earliest` (its
  backfilled row deleted by the ack) while the frontier has not passed it: "group
  has no message" (it is not "published after the group subscribed").
- A running member's own read of the group's numbers (its metrics,
  `monitor.group_numbers` on its READ COMMITTED connection) read `done_pruned`
  and the done rows in separate statements: a prune (or, in the first design, a
  member forgotten) between them counted a message twice or not at all, and the
  counter `pgq_group_done` moved back.
- `pgq show` (text) of a message whose ack deleted its row ahead of the frontier
  says "row pruned behind the frontier" over a line "behind frontier  no".
"""

from __future__ import annotations

import threading
import time

from helpers import invoke, pin_frontier, rows
from sqlalchemy import Engine, text

import pgq
from pgq import monitor
from pgq.consumer.numbers import GroupNumbers
from pgq.records import Outcome
from pgq.settings import settings_from_kwargs
from pgq.sql import status as status_sql
from pgq.store import GroupStore, group_info, run_once
from pgq.store.connections import RoleConnection
from pgq.store.engine import schema_of
from pgq.store.members import forget_departed


def _earlier_forget_departed(engine: Engine, schema: str, gid: int) -> list[str]:
    """The earlier version's `forget_departed` (c622049), as it runs against a schema
    of version 6: a plain delete of the departed member rows that hold no lease
    (its session test is left out: the member here has left and holds no lock)."""
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    f'DELETE FROM "{schema}".member m WHERE m.group_id = :gid'
                    " AND coalesce(m.left_at, m.last_seen) < now() - interval '0 s'"
                    f' AND NOT EXISTS (SELECT 1 FROM "{schema}".delivery d'
                    " WHERE d.group_id = :gid AND d.state = 'leased'"
                    " AND d.lease_owner = m.name) RETURNING m.name"
                ),
                {"gid": gid},
            ).scalars()
        )


def test_attack_ackdel_an_earlier_member_forgetting_a_v6_member_keeps_the_done_count(
    orders: Engine, schema: str
) -> None:
    """During the upgrade window a version-5 member starts (its first maintenance
    round forgets departed members) after a version-6 member finished 30 messages
    and left: the group's done count must stay 30."""
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(30)])
    summary = pgq.Consumer(engine, "billing", lambda m: None, workers=2).run(until_empty=True)
    assert summary.done == 30
    assert pgq.status(engine, "billing")["counts"]["done"] == 30
    gid = group_info(engine, "billing").id

    assert len(_earlier_forget_departed(engine, schema, gid)) == 1

    assert pgq.status(engine, "billing")["counts"]["done"] == 30


def test_attack_ackdel_an_ack_after_the_member_row_was_forgotten_is_still_counted(
    orders: Engine,
) -> None:
    """A member whose session was lost and whose heartbeat went stale held no lease
    when another member forgot it; it then claimed and finished 8 messages before
    its heartbeat found the row gone. The 8 are done: the count must say so."""
    engine = orders
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(8)])
    gid = group_info(engine, "billing").id
    store = GroupStore(gid, "billing", "orders", "m", 30.0, 3)
    run_once(engine, store.join, 30.0, True)
    with engine.begin() as conn:
        assert forget_departed(conn, gid, 0.0) == ["m"]

    claimed = run_once(engine, store.claim, 8, 0)
    applied = run_once(engine, store.record, [Outcome(c, "done") for c in claimed])

    assert len(applied) == 8
    assert len(rows(engine, "billing")) == 1  # the batch's last, kept done
    assert pgq.status(engine, "billing")["counts"]["done"] == 8


def test_attack_ackdel_show_of_a_finished_message_the_group_got_from_earliest(
    engine: Engine,
) -> None:
    """A group subscribed `--from earliest` (the default) gets rows for the messages
    published before it. Once one is finished its row is gone; while the frontier has
    not passed it (held here by a message due in an hour, published first) `pgq show`
    must still say done, as it did when the done row stayed until the frontier."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "other", "t")  # so the pin's delay is kept for `g` too
    pgq.publish(engine, "t", {"pin": True}, delay=3600)  # holds `g`'s frontier
    ids = pgq.publish_many(engine, "t", [{"n": 1}, {"n": 2}])
    pgq.subscribe(engine, "g", "t")  # from earliest: rows for all three
    gid = group_info(engine, "g").id
    store = GroupStore(gid, "g", "t", "m", 30.0, 3)
    run_once(engine, store.join, 30.0, True)
    claimed = run_once(engine, store.claim, 5, 0)
    assert sorted(c.id for c in claimed) == ids
    run_once(engine, store.record, [Outcome(c, "done") for c in claimed])
    assert ids[0] not in rows(engine, "g")  # deleted by its ack

    shown = monitor.message(engine, "g", ids[0])

    assert (shown["state"], shown["row"]) == ("done", "pruned")


def test_attack_ackdel_a_members_numbers_read_keeps_a_member_forgotten_meanwhile(
    orders: Engine, monkeypatch
) -> None:
    """The read of a running member's metrics (`GroupNumbers.refresher` on its own
    connection) while another member's maintenance forgets a departed member, and
    while the frontier prunes the done row a batch kept (from the row counts into
    `done_pruned`): `done` (the counter `pgq_group_done`) must stay 30, neither
    counted twice nor lost between the read's statements (it reads in one snapshot)."""
    engine = orders
    pin_frontier(engine, "orders")  # so the rows the batches kept stay done, unpruned
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(30)])
    summary = pgq.Consumer(engine, "billing", lambda m: None, workers=2).run(until_empty=True)
    assert summary.done == 30
    gid = group_info(engine, "billing").id
    kept = [mid for mid, r in rows(engine, "billing").items() if r.state == "done"]
    assert kept  # the batches' last rows, not pruned yet
    real = status_sql.group_counts

    done_once: list[bool] = []

    def meanwhile():  # between the read of `done_pruned` and of the counts
        if done_once:
            return real()
        done_once.append(True)
        with engine.begin() as other:
            assert len(forget_departed(other, gid, 0.0)) == 1
            other.execute(
                text(
                    f'DELETE FROM "{schema_of(engine)}".delivery'
                    " WHERE group_id = :gid AND state = 'done'"
                ),
                {"gid": gid},
            )  # what the frontier's prune does: the kept rows go into done_pruned
            other.execute(
                text(
                    f'UPDATE "{schema_of(engine)}".group_state'
                    " SET done_pruned = done_pruned + :n WHERE group_id = :gid"
                ),
                {"gid": gid, "n": len(kept)},
            )
        return real()

    numbers = GroupNumbers()
    settings = settings_from_kwargs()
    role = RoleConnection(engine, "numbers", threading.Event())
    try:
        monkeypatch.setattr(status_sql, "group_counts", meanwhile)
        numbers.refresher(role, "billing", settings, time.monotonic)()
    finally:
        role.close()
    latest = numbers.latest()
    assert latest is not None
    assert latest.status.counts.done == 30
    assert pgq.status(engine, "billing")["counts"]["done"] == 30


def test_attack_ackdel_show_text_of_a_row_its_ack_deleted_ahead_of_the_frontier(
    orders: Engine, pgq_env: dict[str, str]
) -> None:
    """The text of `pgq show` must not say the row was pruned behind the frontier
    when the message is not behind it (its own ack deleted the row)."""
    engine = orders
    pgq.publish(engine, "orders", {"pin": True}, delay=3600)  # holds the frontier
    ids = pgq.publish_many(engine, "orders", [{"n": 1}, {"n": 2}])
    gid = group_info(engine, "billing").id
    store = GroupStore(gid, "billing", "orders", "m", 30.0, 3)
    run_once(engine, store.join, 30.0, True)
    claimed = run_once(engine, store.claim, 5, 0)
    run_once(engine, store.record, [Outcome(c, "done") for c in claimed])
    assert monitor.message(engine, "billing", ids[0])["behind_frontier"] is False

    result = invoke(pgq_env, "show", "billing", str(ids[0]))

    assert result.exit_code == 0, result.output
    state = next(line for line in result.stdout.splitlines() if line.startswith("state"))
    assert state.split(None, 1)[1].startswith("done")
    assert "behind the frontier" not in state, result.stdout
