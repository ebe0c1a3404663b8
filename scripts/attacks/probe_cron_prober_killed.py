"""A `pgq consume --until-empty` (cron) run that is the prober is killed mid-probe while
other cron runs follow (ce8e926: the probe slot is reserved for member_ttl and renewed
while the handler runs).

A long-running member opens the group (the dependency of
`probe_kill9_points:handler` is down while `<dir>/down` exists) and is stopped; from
then on only cron runs consume, one after another. The kill point `mid` is armed:
the next cron run that probes kills itself (SIGKILL) half-way through its probe's
handler, and the dependency comes back. Expected: the following cron runs exit 75
while the killed run's slot is still reserved (at most member_ttl), then one probes,
closes, reconciles and drains: the group closes within member_ttl and a few seconds
of the kill, with one CLOSED history row and the refund counts agreeing, and a
later run exits 0 with every row done.

Run: .venv/bin/python scripts/attacks/probe_cron_prober_killed.py (~40 s)
Exit 0 when the behaviour holds, 1 otherwise.
"""

from __future__ import annotations

import signal
import subprocess
import time

from _common import Schema, states, verdict
from _probes import Outage, wait
from probe_kill9_points import SET, TTL

import pgq

CLOSE_WITHIN = TTL + 6.0
problems: list[str] = []
with Schema("cron_prober_killed") as s, Outage(s, "probe_kill9_points:handler", SET) as o:
    out, breaker = o.out, o.breaker

    def cron(name: str, timeout: float = 60) -> tuple[int | None, float]:
        began = time.monotonic()
        with (out / f"{name}.log").open("w") as err:
            proc = o.popen(name, "--until-empty", stderr=err, ATK_PROBE_SLEEP="3")
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
        return code, time.monotonic() - began

    (out / "down").touch()
    m0 = o.popen("m0")
    try:
        if not wait(lambda: breaker()["state"] == "OPEN", 40):
            problems.append(f"setup: the group did not open: {breaker()}")
    finally:
        m0.send_signal(signal.SIGTERM)
        m0.wait(30)
    epoch = breaker()["epoch"]
    runs: list[tuple[str, int | None, float, str]] = []
    if not problems:
        (out / "arm").write_text("mid")
        killed_at = None
        for i in range(60):
            name = f"c{i}"
            code, took = cron(name)
            runs.append((name, code, took, breaker()["state"]))
            if code == -signal.SIGKILL and killed_at is None:
                killed_at = time.monotonic()
                killed_wall = time.time()
                (out / "down").unlink()
            if killed_at is not None and code == 0 and pgq.status(s.engine, "g")["lag"] == 0:
                break
            if killed_at is None and i > 20:
                break
            time.sleep(0.3)
        print("runs: " + ", ".join(f"{n}:{c}/{t:.1f}s/{b}" for n, c, t, b in runs))
        if killed_at is None:
            problems.append("setup: no cron run took the kill")
        else:
            closed_after = next((i for i, r in enumerate(runs) if r[3] == "CLOSED"), None)
            history, closes = o.check_one_close(epoch, problems)
            if closed_after is None or not closes:
                problems.append("the group never closed")
            else:
                import datetime as dt

                at = dt.datetime.fromisoformat(closes[0]["at"]).timestamp()
                spent = at - killed_wall
                print(f"closed {spent:.1f}s after the kill (by {closes[0]['by_member']})")
                if spent > CLOSE_WITHIN:
                    problems.append(f"the group closed {spent:.1f}s after the cron prober's kill")
            st = pgq.status(s.engine, "g")
            in_history = o.refunded_in(history)
            if st["totals"]["refunded"] != in_history:
                problems.append(
                    f"refunded total {st['totals']['refunded']} != history {in_history}"
                )
            if runs[-1][1] != 0 or st["lag"] != 0:
                problems.append(f"the last cron run did not drain: {runs[-1]} {states(s, 'g')}")
            for name, code, _, _ in runs:
                if code not in (0, 75, -signal.SIGKILL):
                    problems.append(f"{name} exited {code}: {o.log(name)[-800:]}")
                o.check_tracebacks(problems, [name])
verdict(problems, "a cron prober killed mid-probe does not hold the group open")
