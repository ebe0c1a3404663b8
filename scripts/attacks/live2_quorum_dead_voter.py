"""The group breaker opens on the vote of a member that was `kill -9`ed before the
open: liveness is now read from `pg_locks` by a statement of its own
(`lock_holders`) and passed to `open_on_quorum` as parameters; a member that dies
between the two statements still counts as live, tripped, when the open decides.

Staging, real processes (min_members 2, quorum 0.5, member_ttl 10 s):
- B, a `pgq consume` member whose handler raises SystemicError, trips its local
  breaker alone (one tripped member < min_members: the group stays CLOSED).
- O, a second such member, trips; its heartbeat transaction takes the breaker-flip
  lock and reads the lock holders (B holds its lock), and O is then paused
  (SIGSTOP, as a GC pause or a preempted VM would) before the open statement.
- B is `kill -9`ed: its session, and with it its lock, is gone (checked in pg_locks).
- O resumes (SIGCONT) and runs the open statement.

Expected (DESIGN §6.2, `session_present`: "kill -9 ends it at once"; open_on_quorum:
"tripped live members must number at least max(min_members, ...)"): one live
tripped member, O, is below min_members 2: the group stays CLOSED. The earlier
version, paused at the same place (after the flip lock, before the open statement),
stays CLOSED: LIVE2_OPENER=old runs O from 6490a38 (TOKEN2_PREV, default
/tmp/pgq_prev2; `git archive 6490a38 pgq | tar -x -C /tmp/pgq_prev2`).

For comparison, LIVE2_OPENER=old_after (or new_after) pauses O right after its open
statement returned, before its transaction commits. Observed 2026-12-01: new -> OPEN
(exit 1), old -> CLOSED (exit 0), old_after -> OPEN (exit 1): the earlier version
commits an open on a member that died meanwhile too, when the pause falls after its
statement; today's window is the gap between the holders read and the open statement
(one more round trip), where "a member that joins in between counts as not holding"
(lock_holders) has its mirror: a member that dies in between counts as holding.

Run: .venv/bin/python scripts/attacks/live2_quorum_dead_voter.py (~20 s)
Exit 1 when the group opened on the dead member's vote.
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
OPENER = os.environ.get("LIVE2_OPENER", "new")

SITE = r"""
import os, signal, sys
if os.environ.get("ATK_PAUSE"):
    _marker = os.environ["ATK_PAUSE"]
    def _pause():
        if not os.path.exists(_marker):
            open(_marker, "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)
    from pgq.store import group as G
    if os.environ.get("ATK_AFTER"):  # pause right after the open statement returned
        _goq = G.GroupStore.open_on_quorum
        def _after(self, *a, **k):
            got = _goq(self, *a, **k)
            _pause()
            return got
        G.GroupStore.open_on_quorum = _after
    elif hasattr(G, "lock_holders"):  # today's: pause after the holders were read
        _lh = G.lock_holders
        def lock_holders(conn, gid, *purposes):
            got = _lh(conn, gid, *purposes)
            if sys._getframe(1).f_code.co_name == "open_on_quorum":
                _pause()
            return got
        G.lock_holders = lock_holders
    else:  # the earlier version: pause at the same place, before the open statement
        from pgq.sql import breaker as B
        _oq = B.open_on_quorum
        def open_on_quorum():
            stmt = _oq()
            _pause()
            return stmt
        B.open_on_quorum = open_on_quorum
"""
HANDLER = r"""
import pgq
def handle(msg):
    raise pgq.SystemicError("down")
"""


def start(s: Schema, d: Path, name: str, code: Path, **extra: str) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    e.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join([str(d), str(code)]),
        PGQ_LEASE="5",
        PGQ_BREAKER_HEARTBEAT="0.3",
        PGQ_BREAKER_MEMBER_TTL="10",
        PGQ_BREAKER_MEMBER_RETENTION="10",
        PGQ_BREAKER_MIN_CALLS="3",
        PGQ_BREAKER_WINDOW="5",
        PGQ_BREAKER_MIN_MEMBERS="2",
        PGQ_BREAKER_QUORUM="0.5",
        PGQ_RETRY_BACKOFF="0.1",
        PGQ_RETRY_BACKOFF_MAX="0.2",
        PGQ_MAX_ATTEMPTS="1000",
        PGQ_POLL_INTERVAL="0.2",
        PGQ_BREAKER_OPEN_FOR="60",
        PGQ_BREAKER_OPEN_FOR_MAX="60",
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
            "1",
            "--name",
            name,
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


def members(s: Schema) -> dict:
    return {
        r[0]: r[1:]
        for r in s.sql(
            f'SELECT name, local_breaker, tripped_epoch, last_seen FROM "{s.name}".member'
        )
    }


def lock_held(s: Schema, name: str) -> bool:
    [(held,)] = s.sql(
        f"""SELECT EXISTS (SELECT 1 FROM pg_locks l, "{s.name}".member m
          WHERE m.name = :n AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(
            to_regclass('"{s.name}".member')::oid::text || ':' || m.group_id || ':' || m.name, 0))""",
        n=name,
    )
    return held


def breaker(s: Schema):
    return s.sql(f'SELECT state, epoch FROM "{s.name}".breaker')


problems: list[str] = []
with Schema("l2quorum") as s:
    d = Path(tempfile.mkdtemp())
    (d / "sitecustomize.py").write_text(SITE)
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish_many(s.engine, "t", [{"i": i} for i in range(100)])
    marker = d / "paused"
    procs = {}
    try:
        procs["B"] = start(s, d, "B", ROOT)
        wait(lambda: members(s).get("B", ("closed",))[0] == "open", "B trips")
        time.sleep(1.0)
        print("B tripped alone; breaker", breaker(s), "members", members(s))
        code = PREV if OPENER.startswith("old") else ROOT
        after = {"ATK_AFTER": "1"} if OPENER.endswith("_after") else {}
        procs["O"] = start(s, d, "O", code, ATK_PAUSE=str(marker), **after)
        wait(marker.exists, "O reaches the open on quorum")
        time.sleep(0.2)  # the SIGSTOP it sent itself has landed
        print(f"O ({OPENER}) paused inside its open; B holds its lock: {lock_held(s, 'B')}")
        procs["B"].kill()
        procs["B"].wait()
        wait(lambda: not lock_held(s, "B"), "B's session ends")
        print("B kill -9ed; its lock held:", lock_held(s, "B"))
        procs["O"].send_signal(signal.SIGCONT)
        time.sleep(1.5)
        br = breaker(s)
        hist = (
            s.sql(f'SELECT epoch, state, at FROM "{s.name}".breaker_history ORDER BY at')
            if s.sql(f"SELECT to_regclass('\"{s.name}\".breaker_history')")[0][0]
            else []
        )
        print("after O resumed: breaker", br, "history", hist)
        log = (d / "O.log").read_text()
        print(
            "O log:",
            [line for line in log.splitlines() if "opened" in line or "quorum" in line][-3:],
        )
        if br and br[0][0] == "OPEN":
            problems.append(
                f"the group opened (breaker {br}) with one live tripped member (O) of"
                f" min_members 2: B was kill -9ed (its lock gone) before the open statement ran"
            )
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()

verdict(problems, f"open on quorum counts only live voters (opener {OPENER}, paused in its open)")
