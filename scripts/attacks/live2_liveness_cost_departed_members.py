"""What a liveness check costs when the group keeps many departed member rows.

Every `pgq consume --until-empty` run leaves a member row behind for
`breaker.member_retention` (1 day by default), under a fresh name (host:pid:random):
a cron job every minute on a few hosts keeps thousands of rows per group. Liveness
is now read by `lock_holders`: every member name of the group is sent to a
`pg_locks` test (`members.holding`) before the statement that needs it, whatever
its age; earlier, the test ran inside the statement, only for the rows the cheap
freshness test let through.

Measured here, the earlier version (6490a38 at TOKEN2_PREV, default /tmp/pgq_prev2)
and today's, on the same server, with 2,000 and then 22,000 departed member rows
(left an hour ago) in one group: `drain_state` (each idle check of a
`--until-empty` run), `open_on_quorum` (each heartbeat of a tripped member) and
`pgq.status`, mean of 5 runs each.

Run: .venv/bin/python scripts/attacks/live2_liveness_cost_departed_members.py (~40 s)
Exit 1 when today's drain check or open costs 10x the earlier version's at 22,000 rows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREV = Path(os.environ.get("TOKEN2_PREV", "/tmp/pgq_prev2")).resolve()

MEASURE = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["ATK_DIR"])
sys.path.append(os.environ["ATK_ROOT"]); sys.path.insert(0, os.environ["ATK_CODE"])
from _common import Schema
import pgq
from pgq.store.topics import group_info
from pgq.store.group import GroupStore
out = {"code": pgq.__file__}
with Schema("l2cost") as s:
    pgq.create_topic(s.engine, "t"); pgq.subscribe(s.engine, "g", "t")
    gid = group_info(s.engine, "g").id
    store = GroupStore(gid, "g", "t", "me", 30.0, 3)
    total = 0
    for n in (2000, 20000):
        s.sql(f"""INSERT INTO "{s.name}".member (group_id, name, host, pid, last_seen, left_at)
            SELECT :g, 'cron-' || i || '-{n}', 'h', i, now() - interval '1 hour',
                   now() - interval '1 hour' FROM generate_series(1, :n) i RETURNING 1""", g=gid, n=n)
        total += n
        with s.engine.begin() as c:
            c.exec_driver_sql(f'ANALYZE "{s.name}".member')
        for what in ("drain_state", "open_on_quorum", "status"):
            t0 = time.perf_counter()
            for _ in range(5):
                if what == "status":
                    pgq.status(s.engine, "g")
                elif what == "drain_state":
                    with s.engine.begin() as c:
                        store.drain_state(c, 10.0)
                else:
                    with s.engine.begin() as c:
                        store.open_on_quorum(c, 0, ttl=10.0, min_members=2, quorum=0.5)
            out[f"{total} {what}"] = (time.perf_counter() - t0) / 5 * 1000
print(json.dumps(out))
'''


def measure(code: Path) -> dict:
    env = dict(
        os.environ, ATK_DIR=str(Path(__file__).parent), ATK_ROOT=str(ROOT), ATK_CODE=str(code)
    )
    r = subprocess.run(
        [sys.executable, "-c", MEASURE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/tmp",
    )
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


before = measure(PREV)
after = measure(ROOT)
print(f"{'':28} {'earlier':>10} {'today':>10}")
problems = []
for key in before:
    if key == "code":
        print(f"{'code':28} {before[key]:>10} {after[key]}")
        continue
    print(f"{key:28} {before[key]:>8.1f}ms {after[key]:>8.1f}ms  x{after[key] / before[key]:.1f}")
    if key.startswith("22000") and key.split()[1] != "status" and after[key] > 10 * before[key]:
        problems.append(f"{key}: {before[key]:.1f} ms -> {after[key]:.1f} ms")
if problems:
    print("DEFECT (liveness checks scale with every departed member row):")
    for p in problems:
        print("  -", p)
    sys.exit(1)
print("held: liveness checks with many departed member rows")
