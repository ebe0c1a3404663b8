"""A member SIGSTOPped past its lease, whose rows were reclaimed (several times),
finished, failed and re-leased, some to a member of its own name and some to itself
after it resumes, writes its stale extension, release, acks, failures and settled
test: none may apply (decision 0004, per-row tokens).

The tokens are arranged so the per-row counter repeats values across rows: the stale
batch names (X, 1) and (Y, 2) while X is now held by the same member name at 2, and
Y at 3. A fence that compared ids and tokens apart would let (X, 1)'s outcome pass
against X's new lease through Y's token.

Real processes: the holder is its own Python process, SIGSTOPped and SIGCONTed; the
reclaimers run in this process under other connections (member "b", and "a" — the
holder's own name).

Run: .venv/bin/python scripts/attacks/fence_paused_stale_outcomes.py (~15 s)
Exit 0 while the fence holds, 1 when a stale write applied or a row changed.
Compare the parent commit: PYTHONPATH=/tmp/prefence .venv/bin/python ...
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, Schema, verdict

import pgq
from pgq.records import Outcome
from pgq.store.group import GroupStore
from pgq.store.topics import group_info

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
json.dump([[x.id, x.seq] for x in held], open(f"{d}/claimed.tmp", "w"))
os.rename(f"{d}/claimed.tmp", f"{d}/claimed")
while not os.path.exists(f"{d}/resumed"):  # the parent SIGSTOPs us here
    time.sleep(0.01)
with engine.begin() as c:  # the holder itself is handed rows again
    again = store.claim(c, 64, 0)
json.dump([[x.id, x.seq] for x in again], open(f"{d}/again.tmp", "w"))
os.rename(f"{d}/again.tmp", f"{d}/again")
while not os.path.exists(f"{d}/go"):
    time.sleep(0.01)
out = {}
leases = [x.lease for x in held]
with engine.begin() as c:
    out["extend"] = sorted(store.extend(c, leases))
with engine.begin() as c:
    out["release"] = sorted(store.release(c, leases))
with engine.begin() as c:
    out["ack"] = sorted(store.record(c, [Outcome(x, "done") for x in held]))
with engine.begin() as c:
    out["fail"] = sorted(store.record(c, [Outcome(x, "retry", 0.0, "message", "boom") for x in held]))
with engine.begin() as c:
    out["dead"] = sorted(store.record(c, [Outcome(x, "dead", 0.0, "permanent", "boom") for x in held]))
with engine.begin() as c:
    out["settled_done"] = sorted(store.settled(c, [Outcome(x, "done") for x in held]))
with engine.begin() as c:
    out["settled_retry"] = sorted(store.settled(c, [Outcome(x, "retry", 0.0, "message", "x") for x in held]))
# its fresh leases must still work
with engine.begin() as c:
    out["fresh_ack"] = sorted(store.record(c, [Outcome(x, "done") for x in again]))
json.dump(out, open(f"{d}/out.tmp", "w"))
os.rename(f"{d}/out.tmp", f"{d}/out")
"""


def wait_for(path: Path, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {path.name}")
        time.sleep(0.01)


def snapshot(s: Schema) -> dict:
    rows = s.sql(
        f"SELECT message_id, state, lease_seq, lease_owner, attempts, reclaims, error_class,"
        f' lease_expires_at FROM "{s.name}".delivery ORDER BY message_id'
    )
    return {r[0]: tuple(r[1:]) for r in rows}


problems: list[str] = []
with Schema("fence_pause") as s:
    d = Path(tempfile.mkdtemp())
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    ids = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(N)])
    info = group_info(s.engine, "g")
    b = GroupStore(info.id, "g", "t", "b", LEASE, 9)
    a2 = GroupStore(info.id, "g", "t", "a", LEASE, 9)  # the holder's name, another process
    warm = set(ids[N // 2 :])
    # the second half two tokens ahead of the first
    with s.engine.begin() as c:
        first = b.claim(c, N, 0)
        b.release(c, [x.lease for x in first if x.id in warm])
    for last in (False, True):  # two tokens ahead
        with s.engine.begin() as c:
            got = b.claim(c, N, 0)
            assert {x.id for x in got} == warm, got
        with s.engine.begin() as c:
            cold_leases = [x.lease for x in first if x.id not in warm] if last else []
            b.release(c, [x.lease for x in got] + cold_leases)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH") or str(ROOT)
    from _common import DSN

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, DSN, s.name, str(d), str(LEASE)], env=env
    )
    try:
        wait_for(d / "claimed")
        held = {i: q for i, q in json.load(open(d / "claimed"))}
        holder.send_signal(signal.SIGSTOP)
        print("holder claimed", held, "and is stopped")
        if len(held) != N:
            problems.append(f"holder claimed {len(held)} of {N}")
        cold = [i for i in ids if i not in warm]
        # round 1: past the lease, b reclaims everything (tokens move on by one)
        time.sleep(LEASE + 0.3)
        with s.engine.begin() as c:
            b.sweep(c)
        with s.engine.begin() as c:
            r1 = b.claim(c, N, 0)
        # b acks one cold row, fails one, lets the rest expire
        with s.engine.begin() as c:
            b.record(c, [Outcome(x, "done") for x in r1 if x.id == cold[0]])
            b.record(c, [Outcome(x, "retry", 0.0, "message", "b") for x in r1 if x.id == cold[1]])
        time.sleep(LEASE + 0.3)
        with s.engine.begin() as c:
            b.sweep(c)
        # round 2: "a" (same name, other process) takes the cold rows, b the warm ones,
        # so a's new token on a cold row equals the holder's stale token on a warm row
        with s.engine.begin() as c:
            r2 = a2.claim(c, N, 0)
        keep = [x for x in r2 if x.id in cold[2:]]
        with s.engine.begin() as c:
            a2.release(c, [x.lease for x in r2 if x.id not in cold[2:]])
        with s.engine.begin() as c:
            r3 = b.claim(c, N, 0)
        with s.engine.begin() as c:  # b finishes one warm row, fails one, holds the rest
            b.record(c, [Outcome(x, "done") for x in r3 if x.id == min(warm)])
            b.record(c, [Outcome(x, "retry", 0.0, "message", "b") for x in r3 if x.id == max(warm)])
        print("a (other process) now holds", {x.id: x.seq for x in keep})
        print("b now holds", {x.id: x.seq for x in r3})
        clash = [
            x.id for x in keep if any(held[w] == x.seq for w in warm)
        ]  # the equal-token pairs the attack needs
        if not clash:
            problems.append("setup: no row holds a token equal to a stale token of another row")
        holder.send_signal(signal.SIGCONT)
        (d / "resumed").touch()
        wait_for(d / "again")
        again = {i: q for i, q in json.load(open(d / "again"))}
        print("holder after SIGCONT re-claimed", again)
        before = snapshot(s)
        (d / "go").touch()
        wait_for(d / "out")
        out = json.load(open(d / "out"))
        after = snapshot(s)
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
    for op in ("extend", "release", "ack", "fail", "dead", "settled_done", "settled_retry"):
        if out[op]:
            problems.append(f"stale {op} applied to {out[op]}")
    for i in ids:
        b4, af = before[i], after[i]
        if i in again:
            if af[0] != "done" or af[1] != again[i]:
                problems.append(f"row {i}: the holder's fresh ack did not apply: {af}")
            continue
        if b4 != af:
            problems.append(f"row {i} changed by stale writes: {b4} -> {af}")
    if sorted(map(tuple, out["fresh_ack"])) != sorted(again.items()):
        problems.append(f"fresh ack applied {out['fresh_ack']}, expected {sorted(again.items())}")
    print("stale results:", {k: v for k, v in out.items()})

verdict(problems, "stale outcomes of a paused member after reclaims and re-leases")
