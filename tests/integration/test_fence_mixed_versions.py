"""The lease fence while members of an earlier version still run beside today's.

A per-row lease token (`lease_seq + 1`, tried in 03999a7 for Citus, reverted in
df012d0) let an earlier member's stale ack land on today's leases under the same
name during an upgrade: this test failed on it. It guards any later change of the
token (decision 0023, section 6) against that.

The earlier version's statements are written out here as it runs them: its claim
draws each row's token from the `lease_token` sequence (one claim of n rows gets n
consecutive values), and its ack, release and extension test ids and tokens apart,
`message_id = ANY(:ids) AND lease_seq = ANY(:seqs) AND lease_owner = :member`.
Found with real processes of both versions (docs/defects.md).

A member of version 5 still marks every row it finishes done, where today's ack
deletes all of a batch but its last row (decision 0037): the frontier prunes and
counts the done rows of both, so the group's done count stays whole while the two
run side by side.
"""

from __future__ import annotations

from helpers import rows, state_of, wait_for_frontier
from sqlalchemy import Engine, select, text

import pgq
from pgq import schema as t
from pgq.records import Outcome
from pgq.store import GroupStore, group_info, run_once


def _earlier_claim(engine: Engine, schema: str, member: str, ids: list[int]) -> list[int]:
    """The earlier version's claim of `ids` in one statement: a token per row from the
    sequence, consecutive within the claim."""
    with engine.begin() as conn:
        rows = conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'leased', lease_owner = :member,"
                f" lease_seq = nextval('\"{schema}\".lease_token'),"
                " lease_expires_at = now() + interval '1 minute'"
                " WHERE message_id = ANY(:ids) RETURNING message_id, lease_seq"
            ),
            {"member": member, "ids": ids},
        ).all()
    tokens = dict(rows)  # type: ignore[arg-type]
    return [tokens[i] for i in ids]


def _earlier_ack(engine: Engine, schema: str, gid: int, member: str, leases) -> list:
    """The earlier version's ack (5b524fa `ack_done`): ids and tokens tested apart."""
    with engine.begin() as conn:
        return conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'done', attempts = attempts + 1,"
                " lease_owner = NULL, lease_expires_at = NULL, updated_at = now()"
                " WHERE group_id = :gid AND message_id = ANY(:ids)"
                " AND lease_seq = ANY(:seqs) AND lease_owner = :member"
                " RETURNING message_id, lease_seq"
            ),
            {
                "gid": gid,
                "member": member,
                "ids": [i for i, _ in leases],
                "seqs": [s for _, s in leases],
            },
        ).all()


def test_an_earlier_members_stale_ack_misses_todays_lease_under_its_name(
    engine: Engine, schema: str
) -> None:
    """An earlier-version member `m` claimed a, b, c (tokens s, s+1, s+2), stalled past
    its lease; a process of today's version under the name `m` (a takeover) claimed
    them again after the sweep. The stalled member's ack of its stale batch must
    apply to none of today's leases."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = pgq.publish_many(engine, "t", [{"n": i} for i in range(3)])
    gid = group_info(engine, "g").id
    stale = list(zip(ids, _earlier_claim(engine, schema, "m", ids), strict=True))
    first = min(s for _, s in stale)
    assert sorted(s for _, s in stale) == [first, first + 1, first + 2]  # one claim
    with engine.begin() as conn:  # the lease runs out while `m` is stalled
        conn.execute(
            text(f"UPDATE \"{schema}\".delivery SET lease_expires_at = now() - interval '1 s'")
        )
    today = GroupStore(gid, "g", "t", "m", 60.0, 3)
    with engine.begin() as conn:
        assert today.sweep(conn).reclaimed == 3
    with engine.begin() as conn:
        fresh = {x.id: x.seq for x in today.claim(conn, 4, 0)}

    applied = _earlier_ack(engine, schema, gid, "m", stale)

    assert applied == []
    with engine.begin() as conn:
        held = conn.execute(
            text(f"SELECT message_id, lease_seq FROM \"{schema}\".delivery WHERE state = 'leased'")
        ).all()
    assert dict(held) == fresh  # type: ignore[arg-type]


def _v5_ack(engine: Engine, schema: str, gid: int, member: str, leases) -> list:
    """Version 5's ack (`ack_done` before 0037): every finished row marked done, with
    today's fence (each id with its own token); nothing counted on the member."""
    with engine.begin() as conn:
        return conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'done', attempts = attempts + 1,"
                " lease_owner = NULL, lease_expires_at = NULL, updated_at = now()"
                " WHERE group_id = :gid AND message_id = ANY(:ids) AND lease_owner = :member"
                " AND (message_id, lease_seq) IN (SELECT * FROM unnest(:ids, :seqs))"
                " RETURNING message_id, lease_seq"
            ),
            {
                "gid": gid,
                "member": member,
                "ids": [c.id for c in leases],
                "seqs": [c.seq for c in leases],
            },
        ).all()


def test_a_version_5_member_marking_rows_done_beside_todays_keeps_the_count_whole(
    engine: Engine, schema: str
) -> None:
    """Messages m0..m5, one transaction each, claimed in turn by today's member `new`
    (m0, m2, m4) and a version-5 member `old` (m1, m3, m5). `new` acks its batch (m0
    and m2 deleted and counted in the group's `done_pruned`, m4 kept done); `old` marks m1 done and
    still holds m3. The frontier stops on m1, the last resolved row before m3, and
    never passes m3; once `old` finishes, it reaches m5 and every row is pruned. The
    done count is the rows and `done_pruned` at each step."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    ids = [pgq.publish(engine, "t", {"n": i}) for i in range(6)]
    gid = group_info(engine, "g").id
    new = GroupStore(gid, "g", "t", "new", 60.0, 3)
    old = GroupStore(gid, "g", "t", "old", 60.0, 3)
    for store in (new, old):
        run_once(engine, store.join, 60.0, True)
    held: dict[str, list] = {"new": [], "old": []}
    for i in range(6):
        store = new if i % 2 == 0 else old
        (claimed,) = run_once(engine, store.claim, 1, 0)
        assert claimed.id == ids[i]
        held[store.member].append(claimed)

    acked = run_once(engine, new.record, [Outcome(c, "done") for c in held["new"]])
    assert acked == {c.lease for c in held["new"]}
    first, pending, last = held["old"]
    assert _v5_ack(engine, schema, gid, "old", [first]) == [tuple(first.lease)]
    found = rows(engine, "g")
    assert sorted(found) == [ids[1], ids[3], ids[4], ids[5]]  # m0, m2 deleted
    states = [state_of(found, i) for i in ids]
    assert states == ["done", "done", "done", "leased", "done", "leased"]

    wait_for_frontier(engine, "g", ids[1], advance=True)
    status = pgq.status(engine, "g")
    assert status["counts"]["done"] == 4  # m4's row, m1 pruned, m0 and m2 deleted
    assert set(rows(engine, "g")) == {ids[3], ids[4], ids[5]}

    assert len(_v5_ack(engine, schema, gid, "old", [pending, last])) == 2
    wait_for_frontier(engine, "g", ids[-1], advance=True)
    assert rows(engine, "g") == {}
    status = pgq.status(engine, "g")
    assert (status["counts"]["done"], status["lag"]) == (6, 0)
    with engine.connect() as conn:
        pruned = conn.scalar(
            select(t.group_state.c.done_pruned).where(t.group_state.c.group_id == gid)
        )
    assert pruned == 6  # m0, m2 by the ack; m1, m3, m4, m5 by the frontier
