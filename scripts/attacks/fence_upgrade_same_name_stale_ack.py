"""During an upgrade, a stalled member of the version before 03999a7 writes its stale
acks, releases and extensions onto the new leases a member of today's version holds
under the same name.

The earlier version draws its tokens from the `lease_token` sequence, so one claim of
n rows gives them consecutive tokens s, s+1, ..., s+n-1, and fences with ids and tokens
tested apart (`message_id = ANY(:ids) AND lease_seq = ANY(:seqs) AND lease_owner =
:member`). Today's claim gives a row its token plus one: the row that had s gets s+1,
the token the earlier claim gave the next row. So when the earlier-version holder was
stalled past its lease (SIGSTOP here; a long GC pause or a network stall does the same)
and a today's-version process took its name over and claimed the rows again, every row
but the last of the batch is held under a token that the stale batch names for another
row: the stale release, extension and ack all apply to the new leases (the row is
released or marked done while the new holder runs it; the new holder's outcome is then
refused).

Decision 0004 names one upgrade corner (an earlier member's claim setting a row's token
lower than the per-row count); it says the earlier members' own fence "stays right for
them". It does not when a process of today's version holds rows under the same name.

Both processes are real: the earlier-version holder runs from a worktree of 5b524fa
(`PGQ_PREFENCE`, default /tmp/prefence: `git worktree add /tmp/prefence 5b524fa`), is
SIGSTOPped past its lease and SIGCONTed after today's "a" claimed the rows.
With today's holder (PGQ_PREFENCE=.) or with both from 5b524fa it holds.

Run: .venv/bin/python scripts/attacks/fence_upgrade_same_name_stale_ack.py (~10 s)
Exit 1 while a stale write of the earlier version applies to a new lease.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DSN, Schema, verdict

import pgq
from pgq.store.group import GroupStore
from pgq.store.topics import group_info

PREFENCE = Path(os.environ.get("PGQ_PREFENCE", "/tmp/prefence")).resolve()
LEASE = 1.0
N = 8
HOLDER = r"""
import json, os, sys, time
import pgq
from pgq.records import Outcome
from pgq.store.group import GroupStore
from pgq.store.topics import group_info

dsn, schema, d, lease = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
engine = pgq.connect(dsn, schema=schema)
info = group_info(engine, "g")
store = GroupStore(info.id, "g", "t", "a", lease, 3)
with engine.begin() as c:
    held = store.claim(c, 64, 0)
json.dump({"code": pgq.__file__, "held": [[x.id, x.seq] for x in held]}, open(f"{d}/claimed.tmp", "w"))
os.rename(f"{d}/claimed.tmp", f"{d}/claimed")
while not os.path.exists(f"{d}/go"):  # SIGSTOPped here
    time.sleep(0.01)
leases = [x.lease for x in held]
out = {}
with engine.begin() as c:
    out["extend"] = sorted(store.extend(c, leases))
with engine.begin() as c:
    out["ack"] = sorted(store.record(c, [Outcome(x, "done") for x in held]))
with engine.begin() as c:
    out["release"] = sorted(store.release(c, leases))
json.dump(out, open(f"{d}/out.tmp", "w"))
os.rename(f"{d}/out.tmp", f"{d}/out")
"""


def wait_for(path: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {path.name}")
        time.sleep(0.01)


def snapshot(s: Schema) -> dict:
    rows = s.sql(
        f'SELECT message_id, state, lease_seq, lease_owner FROM "{s.name}".delivery'
        " ORDER BY message_id"
    )
    return {r[0]: tuple(r[1:]) for r in rows}


if not (PREFENCE / "pgq" / "store" / "group.py").exists():
    raise SystemExit(f"no worktree at {PREFENCE}: git worktree add {PREFENCE} 5b524fa")
problems: list[str] = []
with Schema("fence_upgrade") as s:
    d = Path(tempfile.mkdtemp())
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    ids = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(N)])
    info = group_info(s.engine, "g")
    env = {**os.environ, "PYTHONPATH": str(PREFENCE)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, DSN, s.name, str(d), str(LEASE)], env=env, cwd=d
    )
    out = {}
    try:
        wait_for(d / "claimed")
        claimed = json.load(open(d / "claimed"))
        holder.send_signal(signal.SIGSTOP)
        stale = dict(map(tuple, claimed["held"]))
        print(f"earlier-version holder ({claimed['code']}) claimed {stale}; stopped")
        time.sleep(LEASE + 0.3)
        a = GroupStore(info.id, "g", "t", "a", 30.0, 9)  # today's version, same name
        with s.engine.begin() as c:
            a.sweep(c)
        with s.engine.begin() as c:
            fresh = {x.id: x.seq for x in a.claim(c, N, 0)}
        print(f"today's 'a' ({pgq.__file__}) claimed {fresh}")
        before = snapshot(s)
        holder.send_signal(signal.SIGCONT)
        (d / "go").touch()
        wait_for(d / "out")
        out = json.load(open(d / "out"))
        holder.wait(30)
        after = snapshot(s)
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
    print("stale writes applied:", out)
    for op, applied in out.items():
        if applied:
            problems.append(f"the stale {op} applied to the new leases {applied}")
    for i in ids:
        if before[i] != after[i]:
            problems.append(
                f"row {i}: {before[i]} -> {after[i]} (today's 'a' holds it at {fresh.get(i)})"
            )

verdict(problems, "an earlier-version member's stale writes vs today's leases under its name")
