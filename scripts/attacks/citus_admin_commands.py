"""The admin commands on a Citus schema: status, show, check, requeue, purge, breaker,
members, audit, dead, and the dashboard's `/api/groups`, against the database's truth.

One topic, a group on each worker; 30 messages, 6 of them poison (the handler raises
ValueError; `PGQ_MAX_ATTEMPTS=1`, so they die at once); each group drained by
`pgq consume --until-empty`. Then, per group: `status --json` counts against the rows,
`show` of a done-and-present, a dead and a missing id, `check`, `dead --json`,
`requeue --id` of one dead row, `purge --dead` of the rest, `audit --json`, `breaker
--json`, `members --json`, `status` for all groups; and `/api/groups` of a dashboard.

Expected: every command exits 0 (check: 0/1/2 with one line; show of an unknown id: a
one-line error, exit 2), no traceback, the numbers equal the rows (dead count, ready after
requeue, purged count, audit rows).
Observed: printed; exit 1 on a traceback, an unexpected exit code or a wrong number.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from citus_common import CitusSchema, groups_on_each_worker, verdict

import pgq

problems: list[str] = []


def run(s: CitusSchema, *args: str, ok=(0,), **env: object):
    r = s.pgq(*args, timeout=60, **env)
    out = (r.stdout or "") + (r.stderr or "")
    short = " ".join(args)
    print(f"$ pgq {short} -> rc={r.returncode}\n{out.strip()[:1200]}\n")
    if "Traceback" in out:
        problems.append(f"pgq {short}: traceback: {out[out.find('Traceback') :][:600]}")
    elif r.returncode not in ok:
        problems.append(f"pgq {short}: exit {r.returncode}, {out.strip()[-400:]}")
    return r


def truth(s: CitusSchema, group: str) -> dict[str, int]:
    rows = s.sql(
        f'SELECT state, count(*) FROM "{s.name}".delivery WHERE group_id = :g GROUP BY state',
        g=s.gid(group),
    )
    return {r[0]: r[1] for r in rows}


def main() -> None:
    with CitusSchema("admin") as s, tempfile.TemporaryDirectory() as tmpd:
        pgq.create_topic(s.engine, "t")
        groups = [g for v in groups_on_each_worker(s, "t", "g").values() for g in v]
        Path(tmpd, "poison").write_text("")
        ids = pgq.publish_many(s.engine, "t", [{"n": i, "poison": i % 5 == 0} for i in range(30)])
        poison = [i for n, i in enumerate(ids) if n % 5 == 0]
        for g in groups:
            r = s.pgq(
                "consume",
                g,
                "--handler",
                "citus_handlers:poison",
                "--until-empty",
                "--workers",
                "2",
                timeout=60,
                ATK_DIR=tmpd,
                ATK_TAG=g,
                PGQ_MAX_ATTEMPTS=1,
            )
            print(f"consume {g}: rc={r.returncode} {r.stderr.strip()[-300:]}")
        for g in groups:
            print(f"===== {g} on worker {s.group_port(g)}: rows {truth(s, g)}")
            r = run(s, "status", "--json", g)
            try:
                st = json.loads(r.stdout)
                counts = st.get("counts", {})
                tr = truth(s, g)
                if counts.get("dead") != tr.get("dead", 0):
                    problems.append(
                        f"status {g}: dead {counts.get('dead')} != rows {tr.get('dead', 0)}"
                    )
            except ValueError:
                problems.append(f"status --json {g}: not JSON: {r.stdout[:200]!r}")
            run(s, "status", g)
            run(s, "show", g, str(poison[0]))
            run(s, "show", "--json", g, str(poison[0]))
            run(s, "show", g, str(ids[1]), ok=(0, 2))
            run(s, "show", g, "999999999", ok=(2,))
            run(s, "check", g, ok=(0, 1, 2))
            run(s, "dead", "--json", g)
            run(s, "requeue", g, "--id", str(poison[0]), "--reason", "atk")
            tr = truth(s, g)
            if tr.get("ready", 0) != 1 or tr.get("dead", 0) != len(poison) - 1:
                problems.append(
                    f"requeue {g}: rows after {tr}, want 1 ready and {len(poison) - 1} dead"
                )
            r = run(s, "purge", g, "--dead", "--reason", "atk")
            tr = truth(s, g)
            if tr.get("dead", 0) != 0:
                problems.append(f"purge {g}: {tr.get('dead')} dead rows left")
            r = run(s, "audit", "--json", g)
            try:
                audit = json.loads(r.stdout)
                if len(audit) != 2:
                    problems.append(
                        f"audit {g}: {len(audit)} entries, want 2 (requeue, purge): {audit}"
                    )
            except ValueError:
                problems.append(f"audit --json {g}: not JSON")
            run(s, "breaker", "--json", g)
            run(s, "members", "--json", g)
            run(s, "members", "--all", g)
        run(s, "status")
        run(s, "status", "--json")
        # the dashboard's JSON
        import _web

        with _web.dashboard(s) as server:
            url = server.url if hasattr(server, "url") else f"http://127.0.0.1:{server.port}/"
            ans = _web.request(url, "GET", "/api/groups")
            print(f"/api/groups -> {ans.status} {ans.body[:600]}")
            if ans.status != 200:
                problems.append(f"/api/groups: HTTP {ans.status}: {ans.body[:300]}")
            for g in groups:
                ans = _web.request(url, "GET", f"/groups/{g}")
                if ans.status != 200:
                    problems.append(f"/groups/{g}: HTTP {ans.status}: {ans.body[:300]}")
                ans = _web.request(url, "GET", f"/groups/{g}/messages/{ids[2]}")
                print(f"/groups/{g}/messages/{ids[2]} -> {ans.status}")
                if ans.status >= 500:
                    problems.append(f"message page {g}: HTTP {ans.status}: {ans.body[:300]}")
    verdict(problems, "admin commands on Citus")


if __name__ == "__main__":
    main()
