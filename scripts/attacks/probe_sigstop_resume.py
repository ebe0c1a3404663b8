"""A prober SIGSTOPped mid-probe for longer than member_ttl, another member probes and
closes, then the paused prober is resumed (ce8e926: the probe slot is reserved for
member_ttl and renewed while the handler runs).

Three `pgq consume` members (handler of this module; the dependency is down while
`<dir>/down` exists). Once the group is OPEN and probes fail, the next probe's
handler runs 3 s; 0.5 s into it its process is SIGSTOPped and the dependency comes
back. Expected: another member probes and closes within member_ttl and a few probe
intervals. Then, per variant, the paused one is resumed:

- `late`: after the close and its reconciliation (lease 30 s: the paused probe's
  lease is still valid, so its late success is written);
- `short-lease`: the same with lease 2 s (its lease was reclaimed meanwhile: the late
  outcome must be refused by the lease fence);
- `during`: 0.3 s after the successor's probe started (the successor's probe runs 2 s).

Expected after the resume: one CLOSED history row for the outage, no row refunded
twice (`refunds` <= 1 everywhere), the group's refunded total equal to the history's,
no traceback, and every row done in the end.

Run: .venv/bin/python scripts/attacks/probe_sigstop_resume.py [variant ...] (~1.5 min)
Exit 0 when the behaviour holds, 1 otherwise.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

PROBE_LOG = "probes.log"


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _take(d: Path, name: str, tag: str) -> bool:
    try:
        os.rename(d / name, d / f"{name}-taken-{tag}")
    except FileNotFoundError:
        return False
    return True


def handler(msg) -> None:
    from pgq.consumer import PROBE_THREAD

    d, tag = Path(os.environ["TESTQ_DIR"]), os.environ["TESTQ_TAG"]
    probe = threading.current_thread().name == PROBE_THREAD
    if probe:
        _append(d / PROBE_LOG, f"start {tag} {msg.id} {time.time():.6f}")
        if _take(d, "long", tag):
            time.sleep(3.0)
        elif _take(d, "slow", tag):
            time.sleep(2.0)
        else:
            time.sleep(0.2)
    down = (d / "down").exists()
    if probe:
        _append(d / PROBE_LOG, f"end {tag} {msg.id} {time.time():.6f} {'down' if down else 'ok'}")
    else:
        time.sleep(0.002)
    if down:
        raise ConnectionError("dependency down")


TTL = 1.5
SET = dict(
    PGQ_WORKERS="2",
    PGQ_HANDLER_TIMEOUT="30",
    PGQ_POLL_INTERVAL="0.1",
    PGQ_MAX_ATTEMPTS="50",
    PGQ_RETRY_BACKOFF="0.02",
    PGQ_RETRY_BACKOFF_MAX="0.05",
    PGQ_BREAKER_WINDOW="4",
    PGQ_BREAKER_MIN_CALLS="4",
    PGQ_BREAKER_MIN_MEMBERS="1",
    PGQ_BREAKER_HEARTBEAT="0.2",
    PGQ_BREAKER_MEMBER_TTL=str(TTL),
    PGQ_BREAKER_PROBE_INTERVAL="0.3",
    PGQ_BREAKER_PROBE_INTERVAL_MAX="0.6",
    PGQ_BREAKER_PROBER_TURNS="1000",
)
CLOSE_WITHIN = TTL + 4.0


def wait(predicate, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    return predicate()


def run_variant(variant: str, problems: list[str]) -> None:
    import subprocess
    import tempfile

    from _common import PGQ, Schema, states

    import pgq
    from pgq import monitor

    lease = "2" if variant == "short-lease" else "30"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with Schema("sigstop_" + variant.replace("-", "_")) as s:
        out = Path(tempfile.mkdtemp())
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        ids = pgq.publish_many(s.engine, "t", [{"i": i} for i in range(60)])

        def breaker() -> dict:
            return pgq.status(s.engine, "g")["breaker"]

        victim = None
        try:
            (out / "down").touch()
            for name in ("m1", "m2", "m3"):
                procs[name] = subprocess.Popen(
                    [
                        PGQ,
                        "consume",
                        "g",
                        "--handler",
                        "probe_sigstop_resume:handler",
                        "--name",
                        name,
                    ],
                    env=s.env(TESTQ_DIR=out, TESTQ_TAG=name, PGQ_LEASE=lease, **SET),
                    stdout=subprocess.DEVNULL,
                    stderr=(out / f"{name}.log").open("w"),
                )
            if not wait(lambda: breaker()["state"] == "OPEN", 40):
                problems.append(f"[{variant}] setup: the group did not open: {breaker()}")
                return
            epoch = breaker()["epoch"]
            log = out / PROBE_LOG
            if not wait(lambda: log.exists() and log.read_text().count("end ") >= 2, 20):
                problems.append(f"[{variant}] setup: no failed probes")
                return
            (out / "long").touch()
            taken = wait(lambda: list(out.glob("long-taken-*")), 20)
            if not taken:
                problems.append(f"[{variant}] setup: no long probe")
                return
            victim = taken[0].name.removeprefix("long-taken-")
            time.sleep(0.5)
            procs[victim].send_signal(signal.SIGSTOP)
            if variant == "during":
                (out / "slow").touch()
            (out / "down").unlink()
            back = time.monotonic()
            if variant == "during":
                other = wait(lambda: list(out.glob("slow-taken-*")), 20)
                if not other:
                    problems.append(f"[{variant}] no other member probed while {victim} paused")
                    return
                time.sleep(0.3)
                procs[victim].send_signal(signal.SIGCONT)
            closed = wait(lambda: breaker()["state"] == "CLOSED", 30)
            took = time.monotonic() - back
            print(f"[{variant}] victim={victim} closed={bool(closed)} after {took:.2f}s")
            if not closed:
                problems.append(f"[{variant}] still OPEN {took:.0f}s after, {victim} paused")
            elif took > CLOSE_WITHIN + (2.0 if variant == "during" else 0.0):
                problems.append(f"[{variant}] closed only {took:.1f}s after the recovery")
            if variant != "during":
                time.sleep(3.0)  # reconciliation (and the short lease's reclaim)
                procs[victim].send_signal(signal.SIGCONT)
            time.sleep(5.0)
            if not wait(lambda: pgq.status(s.engine, "g")["counts"]["done"] == len(ids), 60):
                problems.append(f"[{variant}] rows not all done: {states(s, 'g')}")
            history = monitor.breaker_info(s.engine, "g")["history"]
            closes = [h for h in history if h["state"] == "CLOSED" and h["epoch"] > epoch]
            if len(closes) != 1:
                problems.append(f"[{variant}] the outage was closed {len(closes)} times: {closes}")
            st = pgq.status(s.engine, "g")
            in_history = sum(h["refunded"] for h in history if h["state"] == "CLOSED")
            if st["totals"]["refunded"] != in_history:
                problems.append(
                    f"[{variant}] the group's refunded total is {st['totals']['refunded']}, the"
                    f" history's closes count {in_history} ({closes})"
                )
            twice = s.sql(f'SELECT message_id, refunds FROM "{s.name}".delivery WHERE refunds > 1')
            if twice:
                problems.append(f"[{variant}] rows refunded twice: {twice}")
            if st["breaker"]["state"] != "CLOSED":
                problems.append(f"[{variant}] the group reopened: {st['breaker']}")
            text = (out / f"{victim}.log").read_text()
            print(
                f"[{variant}] {victim} after resume: "
                + " | ".join(
                    line[20:130]
                    for line in text.splitlines()
                    if "stepped down" in line
                    or "refused" in line
                    or "renewed" in line
                    or "closed" in line
                )
            )
            for name in procs:
                if "Traceback" in (out / f"{name}.log").read_text():
                    problems.append(f"[{variant}] {name} logged a traceback")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _common import verdict

    problems: list[str] = []
    for variant in sys.argv[1:] or ["late", "short-lease", "during"]:
        run_variant(variant, problems)
    verdict(problems, "a prober paused mid-probe and resumed after a takeover is harmless")


if __name__ == "__main__":
    main()
