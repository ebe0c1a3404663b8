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
import time
from pathlib import Path

from _common import Schema, states
from _probes import Outage, breaker_settings, outage_handler, wait

import pgq


def _take(d: Path, name: str, tag: str) -> bool:
    try:
        os.rename(d / name, d / f"{name}-taken-{tag}")
    except FileNotFoundError:
        return False
    return True


def _probe(d: Path, tag: str) -> None:
    if _take(d, "long", tag):
        time.sleep(3.0)
    elif _take(d, "slow", tag):
        time.sleep(2.0)
    else:
        time.sleep(0.2)


def handler(msg) -> None:
    outage_handler(msg, _probe, mark_outcome=True)


TTL = 1.5
SET = breaker_settings(TTL)
CLOSE_WITHIN = TTL + 4.0


def run_variant(variant: str, problems: list[str]) -> None:
    lease = "2" if variant == "short-lease" else "30"
    with (
        Schema("sigstop_" + variant.replace("-", "_")) as s,
        Outage(
            s,
            "probe_sigstop_resume:handler",
            SET | {"PGQ_LEASE": lease},
            tag=f"[{variant}] ",
            resume=True,
        ) as o,
    ):
        out, procs = o.out, o.procs
        epoch = o.open_outage(problems)
        if epoch is None:
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
        closed = wait(lambda: o.breaker()["state"] == "CLOSED", 30)
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
        if not wait(o.all_done, 60):
            problems.append(f"[{variant}] rows not all done: {states(s, 'g')}")
        history, closes = o.check_one_close(epoch, problems)
        st = pgq.status(s.engine, "g")
        in_history = o.refunded_in(history)
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
        text = o.log(victim)
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
        o.check_tracebacks(problems)


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
