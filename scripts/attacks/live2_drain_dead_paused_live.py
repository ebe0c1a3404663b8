"""`pgq consume --until-empty` (the drain) while three other real members hold
leases: A is `kill -9`ed, B is SIGSTOPped (its session and lock stay, its heartbeat
goes stale), C is live with slow handlers. Liveness is now read from `pg_locks` in a
statement of its own and passed to `drain_state` as parameters (`holds`).

Expected: the drain does not end while A's or B's rows are leased (they are not
live: their leases must expire and be reclaimed, by the drain), does not wait for
ever on them (A's lock went with its session, B's heartbeat is older than the ttl),
and may end while C (live) still holds its rows.

Run: .venv/bin/python scripts/attacks/live2_drain_dead_paused_live.py (~30 s)
Exit 1 when the drain ended early or hung.
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

HANDLER = r"""
import os, time
def handle(msg):
    who = os.environ["ATK_MEMBER"]
    time.sleep({"A": 60, "B": 60, "C": 8}.get(who, 0.0))
"""
LEASE, TTL = 2.0, 1.0


def env(s: Schema, d: Path, name: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    e.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
        ATK_MEMBER=name,
        PGQ_LEASE=str(LEASE),
        PGQ_BREAKER_HEARTBEAT="0.3",
        PGQ_BREAKER_MEMBER_TTL=str(TTL),
        PGQ_PREFETCH="1",
        PGQ_POLL_INTERVAL="0.1",
        PGQ_HANDLER_TIMEOUT="120",
        PGQ_SHUTDOWN_GRACE="1",
    )
    return e


def start(s, d, name, *extra):
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
            *extra,
        ],
        env=env(s, d, name),
        stdout=log,
        stderr=log,
        cwd=d,
    )


def leased(s: Schema) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, owner in s.sql(
        f"SELECT message_id, lease_owner FROM \"{s.name}\".delivery WHERE state = 'leased'"
        " ORDER BY 1"
    ):
        out.setdefault(owner, []).append(i)
    return out


def wait_held(s: Schema, name: str, n: int, timeout: float = 15) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = leased(s).get(name, [])
        if len(got) >= n:
            return got
        time.sleep(0.05)
    raise SystemExit(f"{name} never held {n} rows: {leased(s)}")


problems: list[str] = []
with Schema("l2drain") as s:
    d = Path(tempfile.mkdtemp())
    (d / "atk_h.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    procs = {}
    held = {}
    try:
        for name in "ABC":
            pgq.publish_many(s.engine, "t", [{"who": name, "i": i} for i in range(3)])
            procs[name] = start(s, d, name)
            held[name] = wait_held(s, name, 3)
        print("held before", held)
        procs["A"].kill()
        procs["A"].wait()
        procs["B"].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        drain = start(s, d, "D", "--until-empty")
        try:
            drain.wait(45)
        except subprocess.TimeoutExpired:
            drain.kill()
            problems.append("the drain did not end within 45 s")
        took = time.monotonic() - t0
        after = leased(s)
        st = dict(s.sql(f'SELECT message_id, state FROM "{s.name}".delivery ORDER BY 1'))
        print(f"drain rc={drain.returncode} after {took:.1f}s; leased now {after}; states {st}")
        for name in "AB":
            for i in held[name]:
                if st.get(i) not in ("done", None):
                    problems.append(
                        f"the drain ended while {name}'s row {i} ({'killed' if name == 'A' else 'paused'}"
                        f" member) is {st.get(i)} (leased by {[o for o, ids in after.items() if i in ids]})"
                    )
        print((d / "D.log").read_text()[-600:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()

verdict(problems, "drain with a killed, a paused and a live member holding leases")
