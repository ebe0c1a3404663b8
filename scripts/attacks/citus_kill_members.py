"""Members killed (`kill -9`) mid-claim and mid-ack, paused past their lease
(SIGSTOP ... SIGCONT) and restarted under the same name, on Citus.

One topic, a group on each worker, three `pgq consume` members per group (lease 2 s,
handler `citus_handlers:record` sleeping 5 ms). A publisher thread publishes batches
through `pgq.publish_many` for `ATK_SECONDS` (default 35); a chaos loop meanwhile every
0.3-1 s either kill -9s a random member and restarts it under the same name, or SIGSTOPs
one for 3 s (past its lease) and SIGCONTs it. Then the members are stopped (SIGTERM) and
one `pgq consume --until-empty` per group drains what is left.

Expected: per group every published message handled at least once; a message handled
twice only when one of its handlers ran in a process that was killed or paused (a
reclaim); at the end no ready/leased row, no leased row without an owner, `status`
counts equal to the rows, and the frontier at the last row (all rows pruned).
Observed: printed; exit 1 on a loss, an unexplained duplicate or a stuck row.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from citus_common import PGQ, CitusSchema, groups_on_each_worker, verdict

import pgq

SECONDS = float(os.environ.get("ATK_SECONDS", "35"))
SETTINGS = {
    "PGQ_LEASE": 2,
    "PGQ_POLL_INTERVAL": 0.2,
    "PGQ_WORKERS": 2,
    "PGQ_BATCH_SIZE": 10,
    "PGQ_BREAKER_HEARTBEAT": 0.3,
    "PGQ_BREAKER_MEMBER_TTL": 2,
    "PGQ_MAX_RECLAIMS": 100,
    "PGQ_MAX_ATTEMPTS": 100,
}


def main() -> None:
    problems: list[str] = []
    rnd = random.Random(int(os.environ.get("ATK_SEED", "3")))
    with CitusSchema("kill") as s, tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        pgq.create_topic(s.engine, "t")
        groups = [g for v in groups_on_each_worker(s, "t", "g").values() for g in v]
        print("topic on", s.topic_port("t"), {g: s.group_port(g) for g in groups})
        procs: dict[tuple[str, str], subprocess.Popen] = {}
        disturbed: set[int] = set()
        logs = []

        def spawn(g: str, name: str) -> None:
            log = open(tmp / f"log-{name}", "ab")
            logs.append(log)
            procs[(g, name)] = subprocess.Popen(
                [PGQ, "consume", g, "--handler", "citus_handlers:record", "--name", name],
                env=s.env(ATK_DIR=tmpd, ATK_TAG=g, ATK_SLEEP=0.005, **SETTINGS),
                stdout=log,
                stderr=log,
            )

        for g in groups:
            for k in range(3):
                spawn(g, f"{g}-m{k}")
        stop = threading.Event()
        published: list[int] = []

        def publisher() -> None:
            n = 0
            while not stop.is_set():
                try:
                    published.extend(
                        pgq.publish_many(s.engine, "t", [{"n": n + j} for j in range(5)])
                    )
                except Exception as exc:
                    print("publish refused:", exc)
                n += 5
                time.sleep(0.05)

        pub = threading.Thread(target=publisher)
        pub.start()
        time.sleep(3)
        events = {"kill9": 0, "stop": 0}
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            (g, name) = rnd.choice(sorted(procs))
            p = procs[(g, name)]
            if rnd.random() < 0.6:
                p.kill()
                p.wait()
                disturbed.add(p.pid)
                events["kill9"] += 1
                spawn(g, name)
            else:
                disturbed.add(p.pid)
                p.send_signal(signal.SIGSTOP)
                time.sleep(3)
                p.send_signal(signal.SIGCONT)
                events["stop"] += 1
            time.sleep(rnd.uniform(0.3, 1.0))
        stop.set()
        pub.join()
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                problems.append(f"member pid {p.pid} still running 40 s after SIGTERM")
                p.kill()
        for g in groups:
            r = s.pgq(
                "consume",
                g,
                "--handler",
                "citus_handlers:record",
                "--until-empty",
                timeout=60,
                ATK_DIR=tmpd,
                ATK_TAG=g,
                **{**SETTINGS, "PGQ_LEASE": 2},
            )
            if r.returncode != 0:
                problems.append(f"drain {g}: rc={r.returncode} {r.stderr[-400:]}")
        time.sleep(1)
        print(f"published {len(published)}; events {events}")
        for g in groups:
            seen: dict[int, list[int]] = {}
            for line in (tmp / f"ok-{g}").read_text().splitlines():
                mid, _att, pid = line.split()[:3]
                seen.setdefault(int(mid), []).append(int(pid))
            lost = sorted(set(published) - set(seen))
            dups = {m: p for m, p in seen.items() if len(p) > 1}
            unexplained = {m: p for m, p in dups.items() if not disturbed & set(p[:-1])}
            rows = s.sql(
                f"SELECT state, count(*), count(*) FILTER (WHERE state = 'leased' AND lease_owner IS NULL)"
                f' FROM "{s.name}".delivery WHERE group_id = :g GROUP BY state',
                g=s.gid(g),
            )
            st = pgq.status(s.engine, g)
            print(
                f"{g}: handled {len(seen)}, lost {len(lost)}, twice {len(dups)} (unexplained"
                f" {len(unexplained)}), rows {rows}, status counts {st.get('counts')}"
            )
            if lost:
                problems.append(f"{g}: lost {len(lost)}: {lost[:10]}")
            if unexplained:
                problems.append(
                    f"{g}: handled twice with no killed/paused handler: {list(unexplained.items())[:5]}"
                )
            if any(r[0] in ("ready", "leased") for r in rows):
                problems.append(f"{g}: rows left unresolved after the drain: {rows}")
        for log in logs:
            log.close()
        trace = [f.name for f in tmp.glob("log-*") if b"Traceback" in f.read_bytes()]
        if trace:
            first = (tmp / trace[0]).read_bytes().decode(errors="replace")
            print(f"tracebacks in {trace}:\n{first[first.find('Traceback') :][:1500]}")
    verdict(problems, "kill -9, SIGSTOP past the lease and same-name restarts on Citus")


if __name__ == "__main__":
    main()
