"""`forget_departed` (now fed by a separate `pg_locks` read, `lock_holders`) running
continuously while real members are paused past the retention, resumed, `kill -9`ed
and restarted under the same name.

Three `pgq consume` members (heartbeat 0.3 s, member_ttl 1 s); this script runs
`pgq.store.members.forget_departed(after=1 s)` (what the maintenance task runs with
`breaker.member_retention` = 1 s) in a tight loop on its own connection. A live
member, or a paused one (its session still holds its lock), must never be
forgotten: a member whose row is deleted finds nothing at its next heartbeat and
stops ("member name taken over by another process"). A killed member may be
forgotten; its restart under the same name must still join and run.

Run: .venv/bin/python scripts/attacks/live2_forget_vs_paused_and_restarted.py (~45 s)
Exit 1 when a live or paused member was forgotten (it stopped, or its row is gone
while it runs).
"""

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import DSN, ROOT, Schema, verdict

import pgq
from pgq.store.members import forget_departed
from pgq.store.topics import group_info

SECONDS = float(os.environ.get("LIVE2_SECONDS", "30"))
HANDLER = r"""
import time
def handle(msg):
    time.sleep(0.02)
"""


def start(s: Schema, d: Path, name: str) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    e.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
        PGQ_LEASE="2",
        PGQ_BREAKER_HEARTBEAT="0.3",
        PGQ_BREAKER_MEMBER_TTL="1",
        PGQ_BREAKER_MEMBER_RETENTION="1",
        PGQ_POLL_INTERVAL="0.2",
    )
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
        env=e,
        stdout=log,
        stderr=log,
        cwd=d,
    )


rng = random.Random(int(os.environ.get("LIVE2_SEED", "3")))
problems: list[str] = []
with Schema("l2forget") as s:
    d = Path(tempfile.mkdtemp())
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    gid = group_info(s.engine, "g").id
    names = ["m1", "m2", "m3"]
    procs = {n: start(s, d, n) for n in names}
    stopped = threading.Event()
    forgotten: list[tuple[float, list[str]]] = []

    def forget_loop() -> None:
        while not stopped.is_set():
            with s.engine.begin() as c:
                gone = forget_departed(c, gid, 1.0)
            if gone:
                forgotten.append((time.monotonic(), gone))
            time.sleep(0.01)

    time.sleep(3)
    t = threading.Thread(target=forget_loop, daemon=True)
    t.start()
    counts = {"pause": 0, "kill": 0}
    unexpected: list[str] = []
    try:
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            pgq.publish_many(s.engine, "t", [{"i": i} for i in range(20)])
            name = rng.choice(names)
            p = procs[name]
            if rng.random() < 0.6:
                p.send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(1.5, 3.0))  # past the ttl and the retention
                p.send_signal(signal.SIGCONT)
                counts["pause"] += 1
            else:
                p.kill()
                p.wait()
                time.sleep(rng.uniform(0, 2.0))
                procs[name] = start(s, d, name)
                counts["kill"] += 1
            time.sleep(rng.uniform(0.3, 1.0))
            for n, q in procs.items():
                if q.poll() is not None:
                    unexpected.append(f"{n} (pid {q.pid}) exited rc={q.returncode}")
                    procs[n] = start(s, d, n)
        time.sleep(1.5)
        rows = {r[0] for r in s.sql(f'SELECT name FROM "{s.name}".member')}
        for n, q in procs.items():
            if q.poll() is None and n not in rows:
                problems.append(f"{n} runs (pid {q.pid}) but its member row is gone")
    finally:
        stopped.set()
        t.join(5)
        for q in procs.values():
            q.send_signal(signal.SIGCONT)
            q.kill()
            q.wait()
    taken = []
    for n in names:
        for line in (d / f"{n}.log").read_text().splitlines():
            if "taken over" in line or "already running" in line:
                taken.append(f"{n}: {line}")
    print(
        "actions",
        counts,
        "forget calls that deleted:",
        len(forgotten),
        "names:",
        sorted({x for _, g in forgotten for x in g}),
    )
    problems += [f"member stopped or refused: {x}" for x in taken]
    problems += [f"unexpected exit: {x}" for x in unexpected]

verdict(problems, "forget_departed never forgets a live or paused member")
