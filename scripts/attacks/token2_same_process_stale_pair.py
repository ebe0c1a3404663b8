"""One `pgq.Consumer` process whose handler for X (claim t1) outlives its lease
while the same process re-claims X together with Y (claim t2); the stale outcome of
X (t1) and the fresh outcome of Y (t2) are finished at the same instant, so the
acker writes them in one batch. Decision 0004: all rows of one claim share a token,
so the fence must match pairs; the batch must apply to Y only, X stays leased under
t2 until its second handler finishes.

Real process: the consumer runs in a child Python process (lease 1 s, extensions by
its own maintenance thread), is SIGSTOPped past its lease; this process sweeps X
back to ready as another member ("sweeper"), publishes Y and SIGCONTs it. Every
GroupStore claim / record / extend / release / settled of the child is logged with
the leases it named and the leases the database applied.

Run: .venv/bin/python scripts/attacks/token2_same_process_stale_pair.py (~15 s)
Exit 0 while the fence holds; 1 when a stale pair applied to a newer lease.
Outcome kinds: TOKEN2_KIND=done (default) | retry | dead.
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

KIND = os.environ.get("TOKEN2_KIND", "done")
LEASE = 1.0

CHILD = r"""
import json, os, sys, time, threading
import pgq
from pgq.store import group as G

dsn, schema, d, kind = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
log = open(f"{d}/audit.jsonl", "a", buffering=1)
lk = threading.Lock()

def emit(**kw):
    with lk:
        log.write(json.dumps(kw) + "\n")

def wrap(name, named_of):
    orig = getattr(G.GroupStore, name)
    def f(self, conn, arg, *a, **k):
        res = orig(self, conn, arg, *a, **k)
        named = named_of(arg)
        applied = sorted([list(x) for x in res])
        emit(op=name, named=named, applied=applied,
             bad=[x for x in applied if x not in named])
        return res
    setattr(G.GroupStore, name, f)

wrap("record", lambda outs: sorted([[o.claimed.id, o.claimed.seq] for o in outs]))
wrap("settled", lambda outs: sorted([[o.claimed.id, o.claimed.seq] for o in outs]))
wrap("extend", lambda ls: sorted([[l.id, l.seq] for l in ls]))
wrap("release", lambda ls: sorted([[l.id, l.seq] for l in ls]))
orig_claim = G.GroupStore.claim
def claim(self, conn, limit, epoch, probe=False):
    rows = orig_claim(self, conn, limit, epoch, probe)
    if rows:
        emit(op="claim", leases=[[r.id, r.seq] for r in rows])
    return rows
G.GroupStore.claim = claim

seen = {}
def handler(msg):
    n = msg.payload["n"]
    seen[n] = seen.get(n, 0) + 1
    nth = seen[n]
    emit(op="start", n=n, id=msg.id, nth=nth)
    open(f"{d}/started_{n}_{nth}", "w").close()
    gate = f"{d}/go1" if (n, nth) in (("X", 1), ("Y", 1)) else f"{d}/go2"
    while not os.path.exists(gate):
        time.sleep(0.005)
    emit(op="finish", n=n, id=msg.id, nth=nth)
    if kind == "retry":
        raise ValueError("boom")
    if kind == "dead":
        raise pgq.PermanentError("boom") if hasattr(pgq, "PermanentError") else ValueError("boom")

engine = pgq.connect(dsn, schema=schema)
c = pgq.Consumer(engine, "g", handler, workers=4, name="p", lease=1.0, prefetch=4,
                 batch_size=8, max_attempts=5, poll_interval=0.05, retry_backoff=30,
                 breaker_heartbeat=0.5, breaker_member_ttl=5, breaker_member_retention=5)
c.run(max_runtime=25)
"""


def wait_for(path: Path, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {path.name}")
        time.sleep(0.005)


def rows(s: Schema) -> dict:
    r = s.sql(
        f'SELECT message_id, state, lease_seq, lease_owner, attempts, reclaims FROM "{s.name}".delivery'
        " ORDER BY message_id"
    )
    return {x[0]: tuple(x[1:]) for x in r}


problems: list[str] = []
with Schema("token2_pair") as s:
    d = Path(tempfile.mkdtemp())
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    [x] = pgq.publish_many(s.engine, "t", [{"n": "X"}])
    info = group_info(s.engine, "g")
    child = subprocess.Popen([sys.executable, "-c", CHILD, DSN, s.name, str(d), KIND])
    try:
        wait_for(d / "started_X_1")
        child.send_signal(signal.SIGSTOP)
        t1 = rows(s)[x][1]
        time.sleep(LEASE + 0.5)
        sweeper = GroupStore(info.id, "g", "t", "sweeper", 30.0, 9)
        with s.engine.begin() as c:
            print("swept", sweeper.sweep(c))
        [y] = pgq.publish_many(s.engine, "t", [{"n": "Y"}])
        child.send_signal(signal.SIGCONT)
        wait_for(d / "started_X_2")
        wait_for(d / "started_Y_1")
        mid = rows(s)
        t2x, t2y = mid[x][1], mid[y][1]
        print(f"X={x} t1={t1}; after SIGCONT X at {mid[x]}, Y={y} at {mid[y]}")
        if t2x != t2y:
            print("note: X and Y were not claimed together this run")
        (d / "go1").touch()  # X (t1) and Y (t2) finish together
        time.sleep(1.0)
        between = rows(s)
        print("after the stale X and fresh Y outcomes:", between)
        if between[x][0] != "leased" or between[x][1] != t2x:
            problems.append(
                f"X's lease {t2x} (held by the running second handler) was ended by the stale"
                f" (X, {t1}) outcome: X is now {between[x]}"
            )
        (d / "go2").touch()
        time.sleep(1.5)
        end = rows(s)
        print("end:", end)
    finally:
        child.send_signal(signal.SIGCONT)
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
    audit = [json.loads(line) for line in open(d / "audit.jsonl")]
    for a in audit:
        if a["op"] in ("record", "settled", "extend", "release"):
            print(" ", a["op"], "named", a["named"], "applied", a["applied"])
            if a["bad"]:
                problems.append(f"{a['op']} named {a['named']} but applied {a['applied']}")
        elif a["op"] == "claim":
            print("  claim", a["leases"])
    batches = [
        a for a in audit if a["op"] == "record" and [x, t1] in a["named"] and len(a["named"]) > 1
    ]
    print("batches naming the stale X with others:", batches)

verdict(problems, f"stale (X,t1) + fresh (Y,t2) in one {KIND} batch of one process")
