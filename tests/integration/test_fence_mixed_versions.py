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
"""

from __future__ import annotations

from sqlalchemy import Engine, text

import pgq
from pgq.store import GroupStore, group_info


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
