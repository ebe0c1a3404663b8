"""kill -9 of the prober at several points of a group probe (ce8e926: the probe slot
is reserved for member_ttl and renewed while the handler runs).

What it does, once per kill point, each in a fresh schema with three `pgq consume`
members (handler: this module's `handler`, a dependency that is down while
`<dir>/down` exists): the group opens, probes fail, then the next probe's own
process is killed with SIGKILL (the handler kills it, so the point is exact):

- `entry`: as the probe's handler starts (right after the claim);
- `mid`: half-way through the probe's handler;
- `after-0`, `after-20ms`: just after the handler returned success (the outcome not
  written yet, or racing it).

The dependency comes back at the kill. Expected: the group closes within
member_ttl and a few probe intervals (handler_timeout is 30 s here: before ce8e926
the slot stayed reserved that long), never two probes' handlers run at once (every
probe logs its start and end; a killed one ends at its process's death), exactly one
CLOSED history row for the outage, and the refund counts agree (the group's
`refunded` total equals the history's).

Run: .venv/bin/python scripts/attacks/probe_kill9_points.py (~2 min)
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


def _take_arm(d: Path, tag: str) -> str | None:
    """The kill point armed for the next probe (only one process gets it)."""
    try:
        os.rename(d / "arm", d / f"armed-{tag}")
    except FileNotFoundError:
        return None
    return (d / f"armed-{tag}").read_text().strip()


def handler(msg) -> None:
    from pgq.consumer import PROBE_THREAD

    d, tag = Path(os.environ["TESTQ_DIR"]), os.environ["TESTQ_TAG"]
    probe = threading.current_thread().name == PROBE_THREAD
    mode = None
    if probe:
        _append(d / PROBE_LOG, f"start {tag} {msg.id} {time.time():.6f}")
        mode = _take_arm(d, tag)
        if mode == "entry":
            os.kill(os.getpid(), signal.SIGKILL)
        half = float(os.environ.get("ATK_PROBE_SLEEP", "0.4")) / 2
        time.sleep(half)
        if mode == "mid":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(half)
    down = (d / "down").exists()
    if probe:
        _append(d / PROBE_LOG, f"end {tag} {msg.id} {time.time():.6f}")
        if mode and mode.startswith("after"):
            delay = float(mode.split(":")[1])
            t = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
            t.daemon = True
            t.start()
    else:
        time.sleep(0.002)
    if down:
        raise ConnectionError("dependency down")


TTL = 1.5
SET = dict(
    PGQ_WORKERS="2",
    PGQ_LEASE="30",
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
"""Seconds the group may stay OPEN after the dependency is back and the prober died."""


def wait(predicate, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    return predicate()


def overlaps(out: Path, deaths: dict[str, float]) -> list[str]:
    """Pairs of probe handler runs that overlap in time (a killed one ends at death)."""
    runs: dict[tuple[str, str], list[float]] = {}
    order: list[tuple[str, str]] = []
    path = out / PROBE_LOG
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        kind, tag, mid, ts = line.split()
        key = (tag, mid)
        if kind == "start":
            # a row probed again by the same member gets a new key
            n = sum(1 for k in order if k[0] == tag and k[1].startswith(mid + "#"))
            key = (tag, f"{mid}#{n}")
            runs[key] = [float(ts), deaths.get(tag, float("inf"))]
            order.append(key)
        else:
            for k in reversed(order):
                if k[0] == tag and k[1].startswith(mid + "#"):
                    runs[k][1] = float(ts)
                    break
    found = []
    items = sorted(runs.items(), key=lambda kv: kv[1][0])
    for i, (ka, (sa, ea)) in enumerate(items):
        for kb, (sb, eb) in items[i + 1 :]:
            if sb < ea - 0.001:
                found.append(f"{ka} [{sa:.3f}, {ea:.3f}] overlaps {kb} [{sb:.3f}, {eb:.3f}]")
    return found


def run_point(point: str, problems: list[str]) -> None:
    import subprocess
    import tempfile

    from _common import PGQ, Schema

    import pgq
    from pgq import monitor

    mode = {"entry": "entry", "mid": "mid", "after-0": "after:0", "after-20ms": "after:0.02"}[point]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with Schema("kill9_" + point.replace("-", "_")) as s:
        out = Path(tempfile.mkdtemp())
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        pgq.publish_many(s.engine, "t", [{"i": i} for i in range(60)])

        def breaker() -> dict:
            return pgq.status(s.engine, "g")["breaker"]

        deaths: dict[str, float] = {}
        try:
            (out / "down").touch()
            for name in ("m1", "m2", "m3"):
                procs[name] = subprocess.Popen(
                    [
                        PGQ,
                        "consume",
                        "g",
                        "--handler",
                        "probe_kill9_points:handler",
                        "--name",
                        name,
                    ],
                    env=s.env(TESTQ_DIR=out, TESTQ_TAG=name, **SET),
                    stdout=subprocess.DEVNULL,
                    stderr=(out / f"{name}.log").open("w"),
                )
            if not wait(lambda: breaker()["state"] == "OPEN", 40):
                problems.append(f"[{point}] setup: the group did not open: {breaker()}")
                return
            epoch = breaker()["epoch"]
            log = out / PROBE_LOG
            if not wait(lambda: log.exists() and log.read_text().count("end ") >= 2, 20):
                problems.append(f"[{point}] setup: no failed probes")
                return
            if mode.startswith("after"):
                (out / "down").unlink()
            (out / "arm").write_text(mode)
            armed = wait(lambda: list(out.glob("armed-*")), 20)
            if not armed:
                problems.append(f"[{point}] setup: no probe took the kill")
                return
            victim = armed[0].name.removeprefix("armed-")
            if wait(lambda: procs[victim].poll() is not None, 10) is False:
                problems.append(f"[{point}] setup: {victim} did not die")
                return
            deaths[victim] = time.time()
            if (out / "down").exists():
                (out / "down").unlink()
            back = time.monotonic()
            closed = wait(lambda: breaker()["state"] == "CLOSED", 40)
            took = time.monotonic() - back
            if not closed:
                problems.append(
                    f"[{point}] the group is still OPEN {took:.1f}s after {victim} was killed"
                    f" and the dependency came back: {breaker()}"
                )
            elif took > CLOSE_WITHIN:
                problems.append(
                    f"[{point}] the group closed {took:.1f}s after {victim} was killed and the"
                    f" dependency came back (member_ttl {TTL}s, allowed {CLOSE_WITHIN:.1f}s)"
                )
            print(f"[{point}] victim={victim} closed after {took:.2f}s")
            time.sleep(2.5)  # reconciliation
            history = monitor.breaker_info(s.engine, "g")["history"]
            closes = [h for h in history if h["state"] == "CLOSED" and h["epoch"] > epoch]
            if len(closes) != 1:
                problems.append(f"[{point}] the outage was closed {len(closes)} times: {closes}")
            total = pgq.status(s.engine, "g")["totals"]["refunded"]
            in_history = sum(h["refunded"] for h in history if h["state"] == "CLOSED")
            if total != in_history:
                problems.append(
                    f"[{point}] refunded total {total} != refunds in the history {in_history}"
                )
            for o in overlaps(out, deaths):
                problems.append(f"[{point}] two probes in flight: {o}")
            for name in procs:
                text = (out / f"{name}.log").read_text()
                if "Traceback" in text:
                    problems.append(f"[{point}] {name} logged a traceback")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
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
    points = sys.argv[1:] or ["entry", "mid", "after-0", "after-20ms"]
    for point in points:
        run_point(point, problems)
    verdict(problems, "a prober killed at any point of its probe does not hold the group open")


if __name__ == "__main__":
    main()
