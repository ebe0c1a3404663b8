"""The group breaker opens on a quorum that never existed at any one instant: the
open statement combines who held a lock when `lock_holders` ran with the member
rows as they are when the statement runs.

Real processes, min_members 2, quorum 0.75 (needed = max(2, ceil(0.75 x live))),
member_ttl 10 s:
- B (handler raises SystemicError) is tripped; G1 and G2 (handler succeeds) are live
  and not tripped. 1 tripped of 3 live: CLOSED.
- O (SystemicError) trips; its heartbeat transaction takes the breaker-flip lock
  and reads the holders (O, B, G1, G2): 2 tripped of 4 live, 3 needed: no quorum.
  O is paused (SIGSTOP, a GC pause or a preempted VM) before its open statement.
- B is `kill -9`ed (its lock is gone: checked), and only then G1 and G2 leave
  cleanly (SIGTERM: left_at set, locks released).
- O resumes.

At no instant were two tripped members live with at most two members live: before
B died 2 of 4 were tripped (3 needed); after, O alone was tripped. Expected: CLOSED.
Today's open counts B live (holder at the read) and G1, G2 not live (left in the
rows): 2 tripped of 2 live, needed 2: OPEN. The earlier version, paused before
(LIVE2_OPENER=old) or after (old_after) its open statement, reads one instant.

Observed 2026-12-01 (ed81055): new -> OPEN (exit 1); old -> CLOSED, old_after ->
CLOSED (exit 0).

Run: .venv/bin/python scripts/attacks/live2_quorum_never_existed.py (~25 s)
Exit 1 when the group opened.
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
        def lock_holders(conn, gid, *purposes, **kw):
            got = _lh(conn, gid, *purposes, **kw)
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
import os, time, pgq
def handle(msg):
    if os.environ["ATK_MEMBER"] in ("O", "B"):
        raise pgq.SystemicError("down")
    time.sleep(0.05)
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
        PGQ_BREAKER_QUORUM="0.75",
        ATK_MEMBER=name,
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
with Schema("l2quorum2") as s:
    d = Path(tempfile.mkdtemp())
    (d / "sitecustomize.py").write_text(SITE)
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish_many(s.engine, "t", [{"i": i} for i in range(2000)])
    marker = d / "paused"
    procs = {}
    try:
        for n in ("G1", "G2", "B"):
            procs[n] = start(s, d, n, ROOT)
        wait(lambda: members(s).get("B", ("closed",))[0] == "open", "B trips")
        wait(lambda: all(lock_held(s, n) for n in ("G1", "G2", "B")), "G1, G2, B hold their locks")
        time.sleep(1.0)
        print(
            "B tripped; breaker", breaker(s), "members", {k: v[:2] for k, v in members(s).items()}
        )
        code = PREV if OPENER.startswith("old") else ROOT
        after = {"ATK_AFTER": "1"} if OPENER.endswith("_after") else {}
        procs["O"] = start(s, d, "O", code, ATK_PAUSE=str(marker), **after)
        wait(marker.exists, "O reaches the open on quorum")
        time.sleep(0.2)
        print(
            f"O ({OPENER}) paused in its open; holders: "
            f"{[n for n in ('O', 'B', 'G1', 'G2') if lock_held(s, n)]}"
        )
        procs["B"].kill()
        procs["B"].wait()
        wait(lambda: not lock_held(s, "B"), "B's session ends")
        print("B kill -9ed; breaker", breaker(s))
        for n in ("G1", "G2"):
            procs[n].send_signal(signal.SIGTERM)
        for n in ("G1", "G2"):
            procs[n].wait(20)
        print(
            "G1, G2 left:",
            {k: v[:2] for k, v in members(s).items()},
            "left_at set:",
            s.sql(f'SELECT name, left_at IS NOT NULL FROM "{s.name}".member ORDER BY 1'),
        )
        print("breaker before O resumes", breaker(s))
        procs["O"].send_signal(signal.SIGCONT)
        time.sleep(1.5)
        br = breaker(s)
        print("after O resumed: breaker", br)
        if br and br[0][0] == "OPEN":
            problems.append(
                f"the group opened ({br}): B died while 2 of 4 live members were tripped (3 needed),"
                " then G1 and G2 left; no instant had a quorum"
            )
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()

verdict(problems, f"open on quorum reads one instant (opener {OPENER}, paused in its open)")
