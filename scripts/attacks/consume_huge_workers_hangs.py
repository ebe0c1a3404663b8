"""`pgq consume --workers 99999999999` spawns threads until the system refuses, then hangs.

What it shows: `--workers` has a lower bound (>= 1) but no upper bound, and nothing checks
that the threads could be started. The member starts thousands of worker threads (8,953
on the test box, ~210 MB RSS, eating the machine's shared thread/pid budget), then the
next `Thread.start()` fails and the process neither exits nor works: it sits there
forever (killed here after 15 s). The same happens with `--workers 100000`, and with the
same value from PGQ_WORKERS or the config file.

Expected (DESIGN §7: a bad config value is one clear line on stderr and exit 2, never a
hang): an upper bound (or a failure to start threads) is reported as exit 2 at once, with
nothing claimed. Actual: no exit within 15 s.

Run: .venv/bin/python scripts/attacks/consume_huge_workers_hangs.py (~20 s; it kills the
process after 15 s). Exit 0 once fixed, 1 while the defect exists. Severity: stall/crash
(a typo in a deployment takes the host's thread budget and never exits).
"""

from _common import Schema, states, verdict

import pgq

problems = []
with Schema("workers") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish(s.engine, "t", {"n": 1})
    r = s.pgq(
        "consume",
        "g",
        "--handler",
        "attack_handlers:ok",
        "--until-empty",
        "--workers",
        "99999999999",
        timeout=15,
    )
    if r.returncode is None:
        problems.append("pgq consume --workers 99999999999 did not exit within 15 s")
    elif r.returncode not in (0, 2) or "Traceback" in r.stderr:
        problems.append(f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    st = states(s, "g")
    if st.get("leased"):
        problems.append(f"rows left leased: {st}")
verdict(problems, "a huge --workers is refused (exit 2) or runs, never hangs")
