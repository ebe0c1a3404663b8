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
import time

from _common import Schema, states, verdict
from _probes import Outage, breaker_settings
from _probes import wait as _wait

TTL = 1.5
SET = breaker_settings(TTL, PGQ_LEASE="5", PGQ_HANDLER_TIMEOUT="10")
GRACE = TTL + 10.0
"""How long the group may stay OPEN after the dependency is back."""


def wait(predicate, seconds: float) -> bool:
    return bool(_wait(predicate, seconds, step=0.1))


problems: list[str] = []
with (
    Schema("paused_prober") as s,
    Outage(s, "outage_handlers:flaky", SET, resume=True) as o,
):
    out, procs, breaker = o.out, o.procs, o.breaker
    (out / "down").touch()
    o.start("m1", "m2", "m3")
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
        if not wait(o.all_done, 60):
            problems.append(f"rows not all done: {states(s, 'g')}")
        time.sleep(2)  # let the resumed prober run a few turns
        o.check_one_close(epoch, problems)
        log = o.log(prober)
        if "Traceback" in log:
            problems.append(f"the resumed prober logged a traceback:\n{log}")
verdict(problems, "a paused prober loses the election within member_ttl")
