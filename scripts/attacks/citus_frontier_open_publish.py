"""Out-of-order commits on Citus: a publish left open while later publishes commit and
are consumed; the group's `committed` position (group_state) must never pass a row
that is still ready or leased.

One topic, a group on each worker. Publisher A opens a transaction and publishes
`a-*` (left open). Publisher B publishes and commits `b-*` in 20 small transactions.
A `pgq consume --until-empty` member per group drains them, then the frontier is
advanced (the member's own statement, `pgq.sql.frontier.advance_frontier`, several
times). A then commits; the members drain again and the frontier advances once more.

Expected: at every check no ready/leased row of a group sorts at or before the
group's committed (xid, id); after A commits each group gets all `a-*` and `b-*`
exactly once, and the frontier reaches the last row (nothing stalls).
Observed: printed; exit 1 on a passed row, a loss, a duplicate or a stall.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from citus_common import CitusSchema, groups_on_each_worker, verdict

import pgq
from pgq.sql import frontier as fsql

A_N, B_N = 5, 40


def advance(s: CitusSchema, gid: int) -> None:
    for _ in range(3):
        with s.engine.begin() as conn:
            conn.execute(fsql.without_jit())
            conn.execute(fsql.advance_frontier(), {"gid": gid})


def passed(s: CitusSchema, gid: int) -> list[tuple]:
    """Ready or leased rows at or before the committed position."""
    return s.sql(
        f"SELECT d.message_id, d.xid::text, d.state, gs.committed_xid::text, gs.committed_id"
        f' FROM "{s.name}".delivery d JOIN "{s.name}".group_state gs ON gs.group_id = d.group_id'
        f" WHERE d.group_id = :g AND gs.group_id = :g AND gs.committed_id IS NOT NULL"
        f" AND d.state IN ('ready', 'leased')"
        f" AND (d.xid, d.message_id) <= (gs.committed_xid, gs.committed_id)",
        g=gid,
    )


def drain(s: CitusSchema, group: str, tmp: Path) -> None:
    r = s.pgq(
        "consume",
        group,
        "--handler",
        "citus_handlers:record",
        "--until-empty",
        "--workers",
        "2",
        timeout=60,
        ATK_DIR=str(tmp),
        ATK_TAG=group,
    )
    if r.returncode != 0:
        print(f"consume {group}: rc={r.returncode} {r.stderr[-800:]}")


def main() -> None:
    problems: list[str] = []
    with CitusSchema("frontier_open") as s, tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        pgq.create_topic(s.engine, "t")
        placed = groups_on_each_worker(s, "t", "g")
        groups = [g for v in placed.values() for g in v]
        print("topic on", s.topic_port("t"), "groups:", {g: s.group_port(g) for g in groups})
        held = s.engine.connect()
        tx = held.begin()
        a_ids = pgq.publish_many(held, "t", [{"k": f"a-{i}"} for i in range(A_N)])
        b_ids: list[int] = []
        for i in range(20):
            b_ids += pgq.publish_many(
                s.engine, "t", [{"k": f"b-{i}-{j}"} for j in range(B_N // 20)]
            )
        for g in groups:
            drain(s, g, tmp)
            gid = s.gid(g)
            advance(s, gid)
            bad = passed(s, gid)
            fr = s.sql(
                f'SELECT committed_xid::text, committed_id FROM "{s.name}".group_state WHERE group_id = :g',
                g=gid,
            )
            print(f"{g} while A open: frontier {fr[0]}; passed unresolved: {bad}")
            if bad:
                problems.append(f"{g}: frontier {fr[0]} passed unresolved rows while A open: {bad}")
        tx.commit()
        held.close()
        for g in groups:
            drain(s, g, tmp)
            gid = s.gid(g)
            advance(s, gid)
            bad = passed(s, gid)
            if bad:
                problems.append(f"{g}: passed unresolved after A committed: {bad}")
            fr = s.sql(
                f'SELECT committed_xid::text, committed_id FROM "{s.name}".group_state WHERE group_id = :g',
                g=gid,
            )
            left = s.sql(f'SELECT count(*) FROM "{s.name}".delivery WHERE group_id = :g', g=gid)[0][
                0
            ]
            print(f"{g} after A: frontier {fr[0]}; rows left {left}")
            if left:
                problems.append(f"{g}: frontier {fr[0]} stalled, {left} rows left after all done")
            seen: dict[int, int] = {}
            f = tmp / f"ok-{g}"
            if f.exists():
                for line in f.read_text().splitlines():
                    mid = int(line.split()[0])
                    seen[mid] = seen.get(mid, 0) + 1
            want = set(a_ids) | set(b_ids)
            lost = sorted(want - set(seen))
            dup = sorted(m for m, c in seen.items() if c > 1)
            if lost:
                problems.append(f"{g}: lost {lost}")
            if dup:
                problems.append(f"{g}: delivered twice {dup}")
    verdict(problems, "the frontier never passes an open publish's rows on Citus")


if __name__ == "__main__":
    main()
