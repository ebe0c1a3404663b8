"""`pgq consume --until-empty` ends while a `kill -9`ed member's rows are still
leased: the drain reads the lock holders (`lock_holders`), and the member dies before
the `drain_state` statement that takes them as parameters; it counts as live, its
leases as someone else's live work, and the drain reports the group empty.

Staging, real processes (lease 3 s, member_ttl 10 s):
- A, a `pgq consume` member, holds every row of the group (its handler sleeps).
- D, `pgq consume --until-empty`, finds nothing ready and checks the drain; it is
  paused (SIGSTOP, as a GC pause or a preempted VM would) right after the holders
  were read, before the drain statement.
- A is `kill -9`ed; its session and lock are gone (checked in pg_locks).
- D resumes.

Expected (fetcher._drained: "nothing is leased but by other live members";
drain_state counts rows "leased by members that are not live — rows whose leases
must expire and be reclaimed"): D waits for A's leases to expire, reclaims and
handles them, and ends with every row done. The earlier version (LIVE2_DRAINER=old,
6490a38 at TOKEN2_PREV, default /tmp/pgq_prev2), paused at the same place (right
before its drain statement), does. For comparison, LIVE2_DRAINER=old_after (or
new_after) pauses right after the drain statement returned instead. Observed 2026-12-01:
new -> ends at once, 3 rows left leased to A (exit 1); old -> waits 9.7 s, reclaims
and handles the 3 rows (exit 0); old_after -> ends at once, 3 rows left (exit 1): the
outcome is the earlier version's with the pause after its statement; what moved is
where a pause (or a death) has that effect.

Run: .venv/bin/python scripts/attacks/live2_drain_dead_holder_between_reads.py (~20 s)
Exit 1 when the drain ended with the dead member's rows still leased.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DSN, ROOT, Schema, verdict

import pgq

PREV = Path(os.environ.get("TOKEN2_PREV", "/tmp/pgq_prev2")).resolve()
DRAINER = os.environ.get("LIVE2_DRAINER", "new")

SITE = r"""
import os, signal, sys
if os.environ.get("ATK_PAUSE"):
    _marker = os.environ["ATK_PAUSE"]
    def _pause():
        if not os.path.exists(_marker):
            open(_marker, "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)
    from pgq.store import group as G
    if os.environ.get("ATK_AFTER"):  # pause right after the drain statement returned
        _gds = G.GroupStore.drain_state
        def _after(self, *a, **k):
            got = _gds(self, *a, **k)
            _pause()
            return got
        G.GroupStore.drain_state = _after
    elif hasattr(G, "lock_holders"):  # today's: pause after the holders were read
        _lh = G.lock_holders
        def lock_holders(conn, gid, *purposes):
            got = _lh(conn, gid, *purposes)
            if sys._getframe(1).f_code.co_name == "drain_state":
                _pause()
            return got
        G.lock_holders = lock_holders
    else:  # the earlier version: pause at the same place, before the drain statement
        from pgq.sql import members as M
        _ds = M.drain_state
        def drain_state():
            stmt = _ds()
            _pause()
            return stmt
        M.drain_state = drain_state
"""
HANDLER = r"""
import os, time
def handle(msg):
    if os.environ["ATK_MEMBER"] == "A":
        time.sleep(60)
"""


def start(s: Schema, d: Path, name: str, code: Path, *args: str, **extra: str):
    e = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    e.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join([str(d), str(code)]),
        ATK_MEMBER=name,
        PGQ_LEASE="3",
        PGQ_BREAKER_HEARTBEAT="0.3",
        PGQ_BREAKER_MEMBER_TTL="10",
        PGQ_BREAKER_MEMBER_RETENTION="10",
        PGQ_POLL_INTERVAL="0.2",
        PGQ_HANDLER_TIMEOUT="120",
        PGQ_SHUTDOWN_GRACE="1",
        **extra,
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
            "4",
            "--name",
            name,
            *args,
        ],
        env=e,
        stdout=log,
        stderr=log,
        cwd=d,
    )


def wait(cond, what: str, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out: {what}")
        time.sleep(0.05)


def lock_held(s: Schema, name: str) -> bool:
    [(held,)] = s.sql(
        f"""SELECT EXISTS (SELECT 1 FROM pg_locks l, "{s.name}".member m
          WHERE m.name = :n AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(
            to_regclass('"{s.name}".member')::oid::text || ':' || m.group_id || ':' || m.name, 0))""",
        n=name,
    )
    return held


def rows(s: Schema):
    return s.sql(f'SELECT message_id, state, lease_owner FROM "{s.name}".delivery ORDER BY 1')


problems: list[str] = []
with Schema("l2drain2") as s:
    d = Path(tempfile.mkdtemp())
    (d / "sitecustomize.py").write_text(SITE)
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish_many(s.engine, "t", [{"i": i} for i in range(3)])
    marker = d / "paused"
    procs = {}
    try:
        procs["A"] = start(s, d, "A", ROOT)
        wait(lambda: [r[1] for r in rows(s)] == ["leased"] * 3, "A leases every row")
        print("A holds", rows(s))
        code = PREV if DRAINER.startswith("old") else ROOT
        after = {"ATK_AFTER": "1"} if DRAINER.endswith("_after") else {}
        t0 = time.monotonic()
        procs["D"] = start(s, d, "D", code, "--until-empty", ATK_PAUSE=str(marker), **after)
        wait(marker.exists, "D reaches its drain check")
        time.sleep(0.2)
        print(f"D ({DRAINER}) paused in its drain check; A holds its lock: {lock_held(s, 'A')}")
        procs["A"].kill()
        procs["A"].wait()
        wait(lambda: not lock_held(s, "A"), "A's session ends")
        print("A kill -9ed; its lock held:", lock_held(s, "A"))
        procs["D"].send_signal(signal.SIGCONT)
        try:
            procs["D"].wait(30)
        except subprocess.TimeoutExpired:
            problems.append("the drain did not end within 30 s")
        left = rows(s)
        print(
            f"D ended rc={procs['D'].returncode} after {time.monotonic() - t0:.1f}s; rows now {left}"
        )
        print("D:", (d / "D.log").read_text().strip().splitlines()[-1])
        still = [r for r in left if r[1] != "done"]
        if procs["D"].returncode == 0 and still:
            problems.append(
                f"`--until-empty` ended (rc 0, 'empty') with {len(still)} rows still leased by the"
                f" kill -9ed member A: {still}"
            )
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()

verdict(
    problems, f"the drain waits for a dead member's leases (drainer {DRAINER}, paused in its check)"
)
