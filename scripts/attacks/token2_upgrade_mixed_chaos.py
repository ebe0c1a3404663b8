"""Rolling upgrade under chaos: real `pgq consume` processes of the earlier version
(6490a38: a positive `nextval` token per row, ids and tokens fenced apart) and of
today's (block tokens -(v*2^20+k), pairwise fence) on one group, with members
SIGSTOPped past their lease and SIGCONTed, `kill -9`ed mid-claim and restarted under
the same name with the other version (upgrade, and back), and paused past the ttl
while a process of either version takes their name over, then resumed (their stale
outcomes carry the same owner name as the new process's leases).

Every GroupStore claim / record / extend / release / settled of every process is
audited (a sitecustomize wrapper, in both versions): the leases the database applied
must be among those the call named (a stale pair that matched a newer lease shows as
an applied lease not named). At the end a today's `pgq consume --until-empty` drains
the rest. Checked: no write outside the fence, nothing lost (every message done),
no message acked done twice, every message handled.

Needs the earlier version's package at TOKEN2_PREV (default /tmp/pgq_prev2):
  mkdir -p /tmp/pgq_prev2 && git archive 6490a38 pgq | tar -x -C /tmp/pgq_prev2

Run: .venv/bin/python scripts/attacks/token2_upgrade_mixed_chaos.py (~60 s)
TOKEN2_SECONDS (default 30) of chaos, TOKEN2_SEED. Exit 1 on a defect.
"""

import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DSN, ROOT, Schema, states, verdict

import pgq

PREV = Path(os.environ.get("TOKEN2_PREV", "/tmp/pgq_prev2")).resolve()
SECONDS = float(os.environ.get("TOKEN2_SECONDS", "30"))
SEED = int(os.environ.get("TOKEN2_SEED", str(int(time.time()))))
LEASE = 1.0
N0 = 400

SITE = r"""
import json, os, threading
_d = os.environ["ATK_DIR"]
_log = open(os.path.join(_d, f"audit-{os.getpid()}.jsonl"), "a", buffering=1)
_lk = threading.Lock()
def emit(**kw):
    kw["pid"] = os.getpid()
    kw["member"] = os.environ.get("ATK_MEMBER")
    kw["ver"] = os.environ.get("ATK_VER")
    with _lk:
        _log.write(json.dumps(kw) + "\n")
try:
    from pgq.store import group as G
except Exception as exc:  # not a pgq process
    G = None
if G is not None:
    def _wrap(name, named_of):
        orig = getattr(G.GroupStore, name)
        def f(self, conn, arg, *a, **k):
            res = orig(self, conn, arg, *a, **k)
            named = named_of(arg)
            applied = sorted([list(x) for x in res])
            kinds = None
            if name == "record":
                kinds = {f"{o.claimed.id}:{o.claimed.seq}": o.kind for o in arg}
            emit(op=name, named=named, applied=applied, kinds=kinds,
                 bad=[x for x in applied if x not in named])
            return res
        setattr(G.GroupStore, name, f)
    _wrap("record", lambda outs: sorted([[o.claimed.id, o.claimed.seq] for o in outs]))
    _wrap("settled", lambda outs: sorted([[o.claimed.id, o.claimed.seq] for o in outs]))
    _wrap("extend", lambda ls: sorted([[l.id, l.seq] for l in ls]))
    _wrap("release", lambda ls: sorted([[l.id, l.seq] for l in ls]))
    _oc = G.GroupStore.claim
    def _claim(self, conn, limit, epoch, probe=False):
        rows = _oc(self, conn, limit, epoch, probe)
        if rows:
            emit(op="claim", leases=[[r.id, r.seq] for r in rows])
        return rows
    G.GroupStore.claim = _claim
"""

HANDLER = r"""
import os, random, time, json
from sitecustomize import emit
def handle(msg):
    emit(op="handle", id=msg.id, attempt=msg.attempt)
    time.sleep(random.uniform(0.0, 0.08))
    if random.random() < 0.08:
        raise ValueError("flaky")
"""


def start(s: Schema, d: Path, name: str, ver: str) -> subprocess.Popen:
    path = [str(d), str(PREV) if ver == "old" else str(ROOT)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(
        PGQ_DSN=DSN,
        PGQ_SCHEMA=s.name,
        PYTHONPATH=os.pathsep.join(path),
        ATK_DIR=str(d),
        ATK_MEMBER=name,
        ATK_VER=ver,
        PGQ_LEASE=str(LEASE),
        PGQ_RETRY_BACKOFF="0.2",
        PGQ_RETRY_BACKOFF_MAX="0.5",
        PGQ_MAX_ATTEMPTS="50",
        PGQ_MAX_RECLAIMS="50",
        PGQ_POLL_INTERVAL="0.1",
        PGQ_BREAKER_HEARTBEAT="0.3",
        PGQ_BREAKER_MEMBER_TTL="1",
        PGQ_BATCH_SIZE="16",
        PGQ_LOG_LEVEL="warning",
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
            "atk_handler:handle",
            "--workers",
            "4",
            "--name",
            name,
        ],
        env=env,
        stdout=log,
        stderr=log,
        cwd=d,
    )


if not (PREV / "pgq" / "store" / "group.py").exists():
    raise SystemExit(f"no earlier version at {PREV} (see the docstring)")
rng = random.Random(SEED)
print("seed", SEED)
problems: list[str] = []
with Schema("t2upg") as s:
    d = Path(tempfile.mkdtemp())
    (d / "sitecustomize.py").write_text(SITE)
    (d / "atk_handler.py").write_text(HANDLER)
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    published = list(pgq.publish_many(s.engine, "t", [{"n": i} for i in range(N0)]))
    vers = {"m1": "old", "m2": "old", "m3": "new", "m4": "new"}
    procs = {n: start(s, d, n, v) for n, v in vers.items()}
    actions = collections.Counter()
    resumed: list[subprocess.Popen] = []
    end = time.monotonic() + SECONDS
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.3, 1.2))
            published += pgq.publish_many(
                s.engine, "t", [{"n": i} for i in range(rng.randint(10, 60))]
            )
            name = rng.choice(sorted(procs))
            p = procs[name]
            act = rng.choice(["stop", "stop", "kill", "kill_claim", "takeover"])
            if act == "takeover":  # paused past the ttl, its name taken over, then resumed
                p.send_signal(signal.SIGSTOP)
                time.sleep(1.4)
                vers[name] = rng.choice(["old", "new"])
                procs[name] = start(s, d, name, vers[name])
                time.sleep(rng.uniform(0.5, 1.5))
                p.send_signal(signal.SIGCONT)
                resumed.append(p)
                time.sleep(1.0)
                actions[
                    "takeover_new_alive" if procs[name].poll() is None else "takeover_refused"
                ] += 1
                actions[
                    "takeover_original_alive" if p.poll() is None else "takeover_original_exited"
                ] += 1
            elif act == "stop":
                p.send_signal(signal.SIGSTOP)
                time.sleep(LEASE + rng.uniform(0.2, 1.5))
                p.send_signal(signal.SIGCONT)
            else:
                if act == "kill_claim":  # land the kill just after a claim of this process
                    time.sleep(rng.uniform(0, 0.05))
                p.kill()
                p.wait()
                vers[name] = rng.choice(["old", "new"])
                procs[name] = start(s, d, name, vers[name])
                time.sleep(1.0)
                actions["restart_alive" if procs[name].poll() is None else "restart_refused"] += 1
            actions[f"{act}"] += 1
    finally:
        for p in resumed:
            if p.poll() is None:
                actions["resumed_still_running"] += 1
                p.kill()
                p.wait()
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    print("actions", dict(actions), "final versions", vers)
    t0 = time.monotonic()
    r = s.pgq(
        "consume",
        "g",
        "--handler",
        "atk_handler:handle",
        "--until-empty",
        "--wait-retries",
        "5",
        "--name",
        "drain",
        "--workers",
        "4",
        PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
        ATK_DIR=str(d),
        ATK_MEMBER="drain",
        ATK_VER="new",
        PGQ_LEASE=str(LEASE),
        PGQ_RETRY_BACKOFF="0.2",
        PGQ_RETRY_BACKOFF_MAX="0.5",
        PGQ_MAX_ATTEMPTS="50",
        PGQ_MAX_RECLAIMS="50",
        timeout=60,
    )
    print(f"drain rc={r.returncode} in {time.monotonic() - t0:.1f}s", r.stderr[-500:])
    st = states(s, "g")
    print("states", st, "published", len(published))
    not_done = s.sql(
        f'SELECT message_id, state, lease_owner, attempts, reclaims FROM "{s.name}".delivery'
        " WHERE state <> 'done' ORDER BY 1"
    )
    if not_done:
        problems.append(f"{len(not_done)} rows not done after the drain: {not_done[:10]}")
    audit = []
    for f in d.glob("audit-*.jsonl"):
        for line in open(f):
            try:
                audit.append(json.loads(line))
            except ValueError:
                pass  # a line cut by kill -9
    handled = {a["id"] for a in audit if a["op"] == "handle"}
    by_ver = collections.Counter((a["ver"], a["member"]) for a in audit if a["op"] == "handle")
    print("handled by (version, member)", dict(by_ver))
    if not any(v == "old" for v, _ in by_ver):
        problems.append("setup: no earlier-version member handled anything")
    missing = set(published) - handled
    if missing:
        problems.append(f"{len(missing)} published messages never handled: {sorted(missing)[:10]}")
    done_applied = collections.Counter()
    calls = collections.Counter()
    refused = collections.Counter()
    for a in audit:
        if a["op"] in ("record", "settled", "extend", "release"):
            calls[(a["op"], a["ver"])] += 1
            named = {tuple(x) for x in a["named"]}
            applied = {tuple(x) for x in a["applied"]}
            refused[(a["op"], a["ver"])] += len(named - applied)
            if a["bad"]:
                problems.append(
                    f"{a['ver']} {a['member']} pid {a['pid']} {a['op']} named {a['named']}"
                    f" but applied {a['applied']}"
                )
            if a["op"] == "record":
                for i, seq in applied:
                    if a["kinds"].get(f"{i}:{seq}") == "done":
                        done_applied[i] += 1
    twice = {i: n for i, n in done_applied.items() if n > 1}
    if twice:
        problems.append(f"messages acked done more than once: {list(twice.items())[:10]}")
    print("audited calls", dict(calls))
    print("refused (named, not applied)", dict(refused))
    tokens = collections.Counter(
        ("neg" if ls[1] < 0 else "pos", a["ver"])
        for a in audit
        if a["op"] == "claim"
        for ls in a["leases"]
    )
    print("claimed rows by token sign and version", dict(tokens))

verdict(problems, "rolling upgrade under SIGSTOP / kill -9 / same-name restarts")
