"""Targeted chaos against real `pgq consume` members, then a drain and the history checker.

Three members (`m1..m3`) of group `work` run while three publishers (one committing
two transactions out of order), an `earliest` subscriber (with an in-process member per
late group) and a retention pass every 0.5 s run. For ATK_SECONDS (default 35) a fault
is injected every ~1.5 s, drawn from:

- kill9:      `kill -9` a member mid-work and restart it under its name at once;
- term_kill:  SIGTERM, then `kill -9` 0.05-0.4 s later (mid-release during shutdown), restart;
- term2:      SIGTERM twice quickly (abort), restart;
- pause:      SIGSTOP past the lease and member_ttl, SIGCONT;
- pause_takeover: SIGSTOP, restart a second process under the same name, SIGCONT the
              original (two processes under one name for a while), then SIGTERM the original;
- lockcut:    pg_terminate_backend of the member's session-lock backend only;
- listencut:  pg_terminate_backend of every LISTEN backend;
- drainer:    a `pgq consume --until-empty` under a fresh name alongside.

Then every member is stopped (SIGTERM), each group drained with `--until-empty`, and
`tests/chaos/history.check` must find nothing lost, no unexplained duplicate, no orphan,
no stale lease, status == logs. ATK_SEED picks the fault sequence.

Run: .venv/bin/python scripts/attacks/chaos_targeted.py  (~80 s; exit 0 when it held)
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

from _common import Schema
from chaos import history
from chaos.drivers import Drivers
from chaos.handlers import AttemptLog
from chaos.procs import CHAOS_SETTINGS, Members

import pgq

SECONDS = float(os.environ.get("ATK_SECONDS", "35"))
SEED = int(os.environ.get("ATK_SEED", str(random.randrange(1 << 30))))
LEASE = float(CHAOS_SETTINGS["PGQ_LEASE"])
TTL = float(CHAOS_SETTINGS["PGQ_BREAKER_MEMBER_TTL"])
TOPIC, GROUP = "chaos", "work"
NAMES = ("m1", "m2", "m3")
KINDS = [
    "kill9",
    "term_kill",
    "term2",
    "pause",
    "pause_takeover",
    "lockcut",
    "listencut",
    "drainer",
]
KINDS = [k for k in KINDS if k in os.environ.get("ATK_KINDS", ",".join(KINDS)).split(",")]


def terminate(s: Schema, where: str, **params: object) -> int:
    rows = s.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {where}", **params)
    return len(rows)


def lock_backend_pids(s: Schema, name: str) -> list[int]:
    key_sql = (
        f"hashtextextended(to_regclass('\"{s.name}\".member')::oid::text || ':' || g.id::text"
        " || ':' || :name, 0)"
    )
    rows = s.sql(
        "SELECT l.pid FROM pg_locks l, "
        + f'"{s.name}".consumer_group g'
        + " WHERE g.name = :g AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
        + f" AND ((l.classid::bigint << 32) | l.objid::bigint) = {key_sql}",
        g=GROUP,
        name=name,
    )
    return [r[0] for r in rows]


def main() -> int:
    rng = random.Random(SEED)
    print(f"seed={SEED} seconds={SECONDS} kinds={KINDS}")
    out = Path(tempfile.mkdtemp(prefix="atk-chaos-"))
    with Schema("chaos") as s:
        engine = s.engine
        pgq.create_topic(engine, TOPIC)
        pgq.subscribe(engine, GROUP, TOPIC)
        base = s.env()
        late_consumers = []

        def on_late(group: str) -> None:
            log = AttemptLog(out, f"in-{group}", sleep=0.002)
            c = pgq.Consumer(
                engine,
                group,
                log,
                workers=2,
                name=f"in-{group}",
                lease=LEASE,
                breaker_heartbeat=0.2,
                breaker_member_ttl=TTL,
                retry_backoff=0.05,
                poll_interval=0.1,
                shutdown_grace=5.0,
            )
            c.start()
            late_consumers.append((c, log))

        notes: list[str] = []
        with Members(base, out, settings={"CHAOSQ_SLEEP": "0.05"}) as members:
            for n in NAMES:
                members.spawn(n, GROUP)
            members.wait_live(engine, GROUP, NAMES, TTL)
            drainers = 0
            with Drivers(engine, TOPIC, seconds=SECONDS) as drivers:
                drivers.publish(threads=3, tx_threads=1, interval=0.03)
                drivers.subscribe(count=2, interval=SECONDS / 3, on_subscribe=on_late)
                drivers.retain(interval=0.5)
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    time.sleep(rng.uniform(0.8, 2.0))
                    latest = {m.name: m for m in members.members if m.name in NAMES}
                    alive = [m for m in latest.values() if m.alive()]
                    for name, m in latest.items():  # whoever exited is restarted
                        if not m.alive():
                            notes.append(f"{name} had exited {m.proc.returncode}; restart")
                            members.spawn(name, GROUP)
                            members.wait_live(engine, GROUP, [name], TTL, timeout=30)
                    if not alive:
                        continue
                    victim = rng.choice(alive)
                    kind = rng.choice(KINDS)
                    t = time.time()

                    def restart(name: str) -> None:
                        members.spawn(name, GROUP)
                        # a signal before the handlers are installed is another finding
                        # (signal_during_interpreter_startup.py): wait until it has joined
                        members.wait_live(engine, GROUP, [name], TTL, timeout=30)

                    if kind == "kill9":
                        victim.kill9()
                        restart(victim.name)
                    elif kind == "term_kill":
                        victim.term()
                        time.sleep(rng.uniform(0.05, 0.4))
                        if victim.alive():
                            victim.kill9()
                        else:
                            victim.wait(1)
                        restart(victim.name)
                    elif kind == "term2":
                        victim.term()
                        time.sleep(rng.uniform(0.0, 0.1))
                        if victim.alive():
                            victim._signal(__import__("signal").SIGTERM, "term")
                        code = victim.wait(15)
                        notes.append(f"term2 {victim.name}: exit {code}")
                        # the second signal exits at once: handlers cut short run again
                        members._record(victim, "kill9")
                        restart(victim.name)
                    elif kind == "pause":
                        victim.pause()
                        time.sleep(LEASE + 1.0)
                        victim.resume()
                    elif kind == "pause_takeover":
                        victim.pause()
                        time.sleep(TTL + 0.5)
                        twin = members.spawn(victim.name, GROUP)
                        members.wait_live(engine, GROUP, [victim.name], TTL, timeout=30)
                        if not twin.alive():
                            notes.append(
                                f"PROBLEM takeover of paused {victim.name} refused: {twin.stderr(3)}"
                            )
                        victim.resume()
                        time.sleep(1.5)
                        victim.term()
                        code = victim.wait(15)
                        notes.append(f"paused original {victim.name} exit {code}")
                    elif kind == "lockcut":
                        pids = lock_backend_pids(s, victim.name)
                        for pid in pids:
                            s.sql("SELECT pg_terminate_backend(:p)", p=pid)
                        notes.append(f"lockcut {victim.name}: {len(pids)} backend(s)")
                    elif kind == "listencut":
                        n = terminate(s, "query LIKE 'LISTEN%' AND datname = current_database()")
                        notes.append(f"listencut: {n}")
                    elif kind == "drainer":
                        drainers += 1
                        members.spawn(f"drainer{drainers}", GROUP, until_empty=True)
                    members.events.append(
                        type(members.events[0])(victim.name, "stop", t, victim.pid)
                    ) if kind in ("lockcut",) else None
                    if kind == "lockcut":
                        members.events.append(
                            type(members.events[0])(
                                victim.name, "cont", time.time() + LEASE, victim.pid
                            )
                        )
                    notes.append(f"{time.strftime('%H:%M:%S')} {kind} {victim.name}")
                record = drivers.wait(timeout=30)
            running = [m for m in members.live()]
            for m in running:
                m.term()
            for c, _ in late_consumers:
                c.request_stop()
            for c, log in late_consumers:
                c.stop(timeout=10)
                log.close()
            for m in running:
                code = m.wait(25)
                if code != 0 and not m.name.startswith("drainer"):
                    notes.append(f"PROBLEM {m.name} exited {code} on SIGTERM: {m.stderr(5)}")
            groups = [GROUP, *(x.group for x in record.subscriptions)]
            drains = [members.spawn(f"drain-{g}", g, until_empty=True) for g in groups]
            for d in drains:
                code = d.wait(60)
                notes.append(f"{d.name}: exit {code} {d.summary()}")
                if code != 0:
                    notes.append(f"PROBLEM {d.name} exited {code}: {d.stderr(10)}")
            summary = history.check(
                engine,
                TOPIC,
                out,
                record=record,
                faults=history.fault_windows(members.events, [], lease=LEASE),
                lease=LEASE,
                member_ttl=TTL,
                cli_env={**base, **CHAOS_SETTINGS},
            )
        print(summary)
        print("\n".join(notes))
        print(f"logs in {out}")
        bad = (not summary.ok) or summary.lost or [n for n in notes if n.startswith("PROBLEM")]
        print("VERDICT:", "DEFECT" if bad else "held", f"seed={SEED}")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
