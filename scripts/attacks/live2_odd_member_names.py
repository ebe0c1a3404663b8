"""Member names the CLI accepts, through today's liveness read: the names now travel
from `member` to Python and back as a text[] parameter (`lock_holders`,
`members.holding`, `holds`), and the prober lock key is computed from the name
parameter (`mark_prober`). Each name runs a real `pgq consume` member; `pgq status
--json` must show it live, and `drain_state` of another member must count it live
(its leases are not "held by a member that is not live").

Run: .venv/bin/python scripts/attacks/live2_odd_member_names.py (~25 s)
Exit 1 when a running member is shown or counted as not live.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DSN, ROOT, Schema, verdict

import pgq
from pgq.store.group import GroupStore
from pgq.store.topics import group_info

NAMES = ['a"b', "a,b", "{x}", "a\\b", "sp ace ", "ünï·cödé", "NULL", "'q'", "(1,2)", "é"]
HANDLER = r"""
import time
def handle(msg):
    time.sleep(30)
"""

problems: list[str] = []
with Schema("l2names") as s:
    d = Path(tempfile.mkdtemp())
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish_many(s.engine, "t", [{"i": i} for i in range(len(NAMES))])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
        PGQ_PREFETCH="1",
        PGQ_HANDLER_TIMEOUT="60",
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from pgq.cli import main; main()",
                "consume",
                "g",
                "--handler",
                "atk_h:handle",
                "--workers",
                "1",
                "--name",
                n,
            ],
            env=env,
            cwd=d,
            stdout=subprocess.DEVNULL,
            stderr=open(d / f"{i}.log", "w"),
        )
        for i, n in enumerate(NAMES)
    ]
    try:
        time.sleep(6)
        for i, p in enumerate(procs):
            if p.poll() is not None:
                problems.append(
                    f"{NAMES[i]!r} exited rc={p.returncode}: {(d / f'{i}.log').read_text()[-300:]}"
                )
        st = json.loads(s.pgq("status", "g", "--json").stdout)
        grp = st["groups"][0] if "groups" in st else st
        shown = {m["name"]: m.get("live") for m in grp["members"]}
        print("status members:", shown)
        for n in NAMES:
            if shown.get(n) is not True:
                problems.append(f"member {n!r} runs but status shows live={shown.get(n)!r}")
        gid = group_info(s.engine, "g").id
        other = GroupStore(gid, "g", "t", "observer", 30.0, 3)
        with s.engine.begin() as c:
            ds = other.drain_state(c, 10.0)
        owners = s.sql(
            f"SELECT lease_owner, count(*) FROM \"{s.name}\".delivery WHERE state = 'leased' GROUP BY 1"
        )
        print("leased by", dict(owners), "drain_state of another member:", ds)
        if ds.held:
            problems.append(
                f"drain_state counts {ds.held} rows as held by members not live: {dict(owners)}"
            )
    finally:
        for p in procs:
            p.kill()
            p.wait()

verdict(problems, "odd member names through the liveness read")
