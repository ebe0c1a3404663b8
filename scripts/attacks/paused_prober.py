"""A SIGSTOPped prober holds the group OPEN for as long as it is paused.

What it shows: three `pgq consume` members open the group (the dependency of
tests/outage_handlers.py is down while a flag file exists); the elected prober is
SIGSTOPped and the dependency comes back. The paused process keeps its database
sessions, so its session-level probe lock stays held: no other member can win the
election, and the group stays OPEN (and every row waits) until the prober resumes.

Expected (DESIGN §6.4: "A prober that stops answering (SIGSTOP, a hung host) loses the
election within `breaker.member_ttl` even though its session lingers"): another member
is elected and closes the group within member_ttl and a few probe intervals; once
resumed, the old prober steps down without closing anything a second time.

Run: .venv/bin/python scripts/attacks/paused_prober.py (~30 s)
Exit 0 once fixed, 1 while the defect exists. Severity: stall (a whole group stops for
as long as one process is paused).
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from pathlib import Path

from _common import PGQ, Schema, states, verdict

import pgq
from pgq import monitor

TTL = 1.5
SET = dict(
    PGQ_WORKERS="2",
    PGQ_LEASE="5",
    PGQ_HANDLER_TIMEOUT="10",
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
GRACE = TTL + 10.0
"""How long the group may stay OPEN after the dependency is back."""


def wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


problems: list[str] = []
procs: dict[str, subprocess.Popen[bytes]] = {}
with Schema("paused_prober") as s:
    out = Path(tempfile.mkdtemp())
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    ids = pgq.publish_many(s.engine, "t", [{"i": i} for i in range(60)])

    def breaker() -> dict:
        return pgq.status(s.engine, "g")["breaker"]

    try:
        (out / "down").touch()
        for name in ("m1", "m2", "m3"):
            procs[name] = subprocess.Popen(
                [PGQ, "consume", "g", "--handler", "outage_handlers:flaky", "--name", name],
                env=s.env(TESTQ_DIR=out, TESTQ_TAG=name, **SET),
                stdout=subprocess.DEVNULL,
                stderr=(out / f"{name}.log").open("w"),
            )
        if not wait(lambda: breaker()["state"] == "OPEN" and breaker()["prober"], 30):
            problems.append(f"setup: the group did not open with a prober: {breaker()}")
        else:
            prober = breaker()["prober"]
            epoch = breaker()["epoch"]
            procs[prober].send_signal(signal.SIGSTOP)
            (out / "down").unlink()
            began = time.monotonic()
            if not wait(lambda: breaker()["state"] == "CLOSED", GRACE):
                problems.append(
                    f"the group is still OPEN {time.monotonic() - began:.0f}s after the dependency"
                    f" came back, while its prober {prober} is paused: {breaker()}"
                )
            procs[prober].send_signal(signal.SIGCONT)
            if not wait(lambda: pgq.status(s.engine, "g")["counts"]["done"] == len(ids), 60):
                problems.append(f"rows not all done: {states(s, 'g')}")
            time.sleep(2)  # let the resumed prober run a few turns
            history = monitor.breaker_info(s.engine, "g")["history"]
            closes = [h for h in history if h["state"] == "CLOSED" and h["epoch"] > epoch]
            if len(closes) != 1:
                problems.append(f"the outage was closed {len(closes)} times: {closes}")
            log = (out / f"{prober}.log").read_text()
            if "Traceback" in log:
                problems.append(f"the resumed prober logged a traceback:\n{log}")
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
verdict(problems, "a paused prober loses the election within member_ttl")
