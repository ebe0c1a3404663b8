"""`pgq status --json` (and `pgq.status`) during an outage with three real members:
the prober it names must be the member whose prober lock a session holds. Now the
name is computed in Python from a separate `pg_locks` read (`inspect._probers`).

Three `pgq consume` members whose handler always raises SystemicError open the group;
the script `kill -9`s the current prober now and then (restarted under the same name;
LIVE2_TURNS=1 also makes it hand over after every failed probe, churn where samples
seldom agree). Independently of pgq, each sample reads `pg_locks` for the members'
prober keys (hashtextextended(oid:prober:gid:name)) right before and right after
status; when both reads and the previous sample's agree, status must name that holder
(or no one when none holds).

Run: .venv/bin/python scripts/attacks/live2_status_prober_outage.py (~45 s)
Exit 1 on a status that names another member than the lock holder.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DSN, ROOT, Schema, verdict

import pgq

HANDLER = r"""
import pgq
def handle(msg):
    raise pgq.SystemicError("down")
"""
SECONDS = float(os.environ.get("LIVE2_SECONDS", "30"))


def env(s: Schema, d: Path, name: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    e.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
        PGQ_LEASE="2",
        PGQ_BREAKER_HEARTBEAT="0.3",
        PGQ_BREAKER_MEMBER_TTL="1.5",
        PGQ_BREAKER_PROBE_INTERVAL="0.3",
        PGQ_BREAKER_PROBE_INTERVAL_MAX="0.6",
        PGQ_BREAKER_PROBER_TURNS=os.environ.get("LIVE2_TURNS", "1000"),
        PGQ_BREAKER_MIN_CALLS="3",
        PGQ_BREAKER_WINDOW="5",
        PGQ_BREAKER_MIN_MEMBERS="2",
        PGQ_RETRY_BACKOFF="0.1",
        PGQ_RETRY_BACKOFF_MAX="0.2",
        PGQ_MAX_ATTEMPTS="1000",
        PGQ_POLL_INTERVAL="0.2",
    )
    return e


def start(s, d, name):
    log = open(d / f"{name}.log", "a")
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from pgq.cli import main; main()",
            "consume",
            "g",
            "--handler",
            "atk_h:handle",
            "--workers",
            "2",
            "--name",
            name,
        ],
        env=env(s, d, name),
        stdout=log,
        stderr=log,
        cwd=d,
    )


def holders(s: Schema) -> set[str]:
    rows = s.sql(
        f"""SELECT m.name FROM "{s.name}".member m
        WHERE EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
          AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(
            to_regclass('"{s.name}".member')::oid::text || ':prober:' || m.group_id || ':' || m.name, 0))"""
    )
    return {r[0] for r in rows}


rng = random.Random(int(os.environ.get("LIVE2_SEED", "7")))
problems: list[str] = []
samples = {"cli": 0, "api": 0, "agree": 0, "open": 0, "kills": 0}
with Schema("l2prober") as s:
    d = Path(tempfile.mkdtemp())
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish_many(s.engine, "t", [{"i": i} for i in range(200)])
    names = ["m1", "m2", "m3"]
    procs = {n: start(s, d, n) for n in names}
    seen_probers: set[str] = set()
    last: set[str] | None = None
    try:
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            before = holders(s)
            if rng.random() < 0.3:
                r = s.pgq("status", "g", "--json", timeout=20)
                try:
                    st = json.loads(r.stdout)
                except ValueError:
                    problems.append(f"status --json rc={r.returncode}: {r.stderr[-300:]}")
                    continue
                samples["cli"] += 1
            else:
                st = pgq.status(s.engine, "g", member_ttl=1.5)
                samples["api"] += 1
            after = holders(s)
            group = st["groups"][0] if "groups" in st else st
            br = group["breaker"]
            if br["state"] != "OPEN":
                time.sleep(0.1)
                continue
            samples["open"] += 1
            named = br["prober"]
            stable = before == after == last
            last = after
            if stable:
                samples["agree"] += 1
                expect = sorted(before)[0] if before else None
                if named != expect:
                    problems.append(
                        f"status names prober {named!r}; pg_locks before and after: {sorted(before)}"
                    )
                if named:
                    seen_probers.add(named)
                if len(before) > 1:
                    problems.append(f"two members hold a prober lock at once: {sorted(before)}")
            if named and rng.random() < 0.15 and named in procs:  # kill -9 the prober
                procs[named].kill()
                procs[named].wait()
                samples["kills"] += 1
                time.sleep(0.05)
                gone = holders(s)
                st2 = pgq.status(s.engine, "g", member_ttl=1.5)
                n2 = (st2["groups"][0] if "groups" in st2 else st2)["breaker"]["prober"]
                if named in gone:
                    print(f"note: {named}'s prober lock still held 50 ms after kill -9")
                elif n2 == named:
                    problems.append(f"status still names the killed prober {named}")
                procs[named] = start(s, d, named)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    print("samples", samples, "probers seen", sorted(seen_probers))
    if samples["agree"] < 10 or len(seen_probers) < 2:
        problems.append(f"setup: too few samples in an outage ({samples}, probers {seen_probers})")

verdict(problems, "status names the member holding the prober lock during an outage")
