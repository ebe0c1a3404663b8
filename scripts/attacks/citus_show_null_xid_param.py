"""`pgq show GROUP ID` (and the dashboard's message page) on Citus fails for every message
that exists: `database error: could not determine data type of parameter $1`.

On Citus `message_in_group` is called with `:message_xid` None (the message's xid is the
coordinator's, 0023 section 5) and tests it with `IS NULL`; sent untyped, PostgreSQL
cannot type the parameter. One server passes the xid, so it never meets this.

One topic, a group on each worker, 3 messages, one consumed to done. For each group:
`pgq show g <id>` of a ready, a done and an unknown id, `pgq show --json`, and
`GET /groups/<g>/messages/<id>` of a dashboard.

Expected: exit 0 with the message (unknown id: exit 2, "has no message"), HTTP 200.
Observed: exit 1 `pgq: error: database error: could not determine data type of parameter
$1` for every existing id, HTTP 500 for the page; exit 1 while so.
"""

from __future__ import annotations

from citus_common import CitusSchema, groups_on_each_worker, verdict

import pgq


def main() -> None:
    import _web  # after citus_common: it points _common at the coordinator

    problems: list[str] = []
    with CitusSchema("show") as s:
        pgq.create_topic(s.engine, "t")
        groups = [g for v in groups_on_each_worker(s, "t", "g").values() for g in v]
        ids = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(3)])
        for g in groups:
            for mid, want in ((ids[0], 0), (ids[1], 0), (999_999_999, 2)):
                r = s.pgq("show", g, str(mid))
                print(
                    f"pgq show {g} {mid} -> rc={r.returncode} {(r.stdout + r.stderr).strip()[:200]!r}"
                )
                if r.returncode != want:
                    problems.append(
                        f"pgq show {g} {mid}: exit {r.returncode} ({r.stderr.strip()}), want {want}"
                    )
            r = s.pgq("show", "--json", g, str(ids[2]))
            if r.returncode != 0:
                problems.append(
                    f"pgq show --json {g} {ids[2]}: exit {r.returncode} ({r.stderr.strip()})"
                )
        with _web.dashboard(s) as server:
            for g in groups:
                ans = _web.request(server.url, "GET", f"/groups/{g}/messages/{ids[0]}")
                print(f"GET /groups/{g}/messages/{ids[0]} -> {ans.status}")
                if ans.status != 200:
                    problems.append(f"GET /groups/{g}/messages/{ids[0]}: HTTP {ans.status}")
    verdict(problems, "pgq show and the message page on Citus")


if __name__ == "__main__":
    main()
