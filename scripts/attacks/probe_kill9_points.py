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

from _common import Schema
from _probes import PROBE_LOG, Outage, breaker_settings, outage_handler, wait


def _take_arm(d: Path, tag: str) -> str | None:
    """The kill point armed for the next probe (only one process gets it)."""
    try:
        os.rename(d / "arm", d / f"armed-{tag}")
    except FileNotFoundError:
        return None
    return (d / f"armed-{tag}").read_text().strip()


def _probe(d: Path, tag: str):
    mode = _take_arm(d, tag)
    if mode == "entry":
        os.kill(os.getpid(), signal.SIGKILL)
    half = float(os.environ.get("ATK_PROBE_SLEEP", "0.4")) / 2
    time.sleep(half)
    if mode == "mid":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(half)
    if mode and mode.startswith("after"):
        return lambda: _kill_after(float(mode.split(":")[1]))
    return None


def _kill_after(delay: float) -> None:
    t = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
    t.daemon = True
    t.start()


def handler(msg) -> None:
    outage_handler(msg, _probe)


TTL = 1.5
SET = breaker_settings(TTL)
CLOSE_WITHIN = TTL + 4.0
"""Seconds the group may stay OPEN after the dependency is back and the prober died."""


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
    mode = {"entry": "entry", "mid": "mid", "after-0": "after:0", "after-20ms": "after:0.02"}[point]
    with (
        Schema("kill9_" + point.replace("-", "_")) as s,
        Outage(s, "probe_kill9_points:handler", SET, tag=f"[{point}] ") as o,
    ):
        out = o.out
        deaths: dict[str, float] = {}
        epoch = o.open_outage(problems)
        if epoch is None:
            return
        if mode.startswith("after"):
            (out / "down").unlink()
        (out / "arm").write_text(mode)
        armed = wait(lambda: list(out.glob("armed-*")), 20)
        if not armed:
            problems.append(f"[{point}] setup: no probe took the kill")
            return
        victim = armed[0].name.removeprefix("armed-")
        if wait(lambda: o.procs[victim].poll() is not None, 10) is False:
            problems.append(f"[{point}] setup: {victim} did not die")
            return
        deaths[victim] = time.time()
        if (out / "down").exists():
            (out / "down").unlink()
        back = time.monotonic()
        closed = wait(lambda: o.breaker()["state"] == "CLOSED", 40)
        took = time.monotonic() - back
        if not closed:
            problems.append(
                f"[{point}] the group is still OPEN {took:.1f}s after {victim} was killed"
                f" and the dependency came back: {o.breaker()}"
            )
        elif took > CLOSE_WITHIN:
            problems.append(
                f"[{point}] the group closed {took:.1f}s after {victim} was killed and the"
                f" dependency came back (member_ttl {TTL}s, allowed {CLOSE_WITHIN:.1f}s)"
            )
        print(f"[{point}] victim={victim} closed after {took:.2f}s")
        time.sleep(2.5)  # reconciliation
        history, _ = o.check_one_close(epoch, problems)
        o.check_refunds(history, problems)
        for ov in overlaps(out, deaths):
            problems.append(f"[{point}] two probes in flight: {ov}")
        o.check_tracebacks(problems)


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
