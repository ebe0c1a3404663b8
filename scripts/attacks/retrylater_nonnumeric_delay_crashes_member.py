"""A `RetryLater` whose `delay` is not a float crashes the member.

What it shows: a RetryLater subclass that exposes the server's Retry-After header as its
`delay` (a property returning the string "120") makes `Handling.failure` call
`math.isfinite("120")` -> TypeError. The worker thread crashes, the member stops
(stop_reason=signal, exit 1), the row stays `leased` until its lease ends, and then the
next member to reclaim it crashes the same way.

Expected (DESIGN §5: a delay that is not finite / out of range "fails as `message` with a
clear error"; §4 "Nothing a handler returns or raises can crash"): the attempt fails as
`message` (dead with max_attempts=1), the run exits 0. Actual: exit 1, row leased.

Run: .venv/bin/python scripts/attacks/retrylater_nonnumeric_delay_crashes_member.py (~5 s)
Exit 0 once fixed, 1 while the defect exists.
"""

from _common import Schema, states, verdict

import pgq

with Schema("retrystr") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish(s.engine, "t", {"n": 1})
    r = s.pgq(
        "consume",
        "g",
        "--handler",
        "attack_handlers:throttled",
        "--until-empty",
        "--workers",
        "1",
        timeout=30,
        PGQ_MAX_ATTEMPTS="1",
        PGQ_BREAKER_MIN_MEMBERS="9",
    )
    st = states(s, "g")
    problems = []
    if r.returncode != 0:
        problems.append(f"pgq consume exited {r.returncode}")
    if "thread crashed" in r.stderr:
        problems.append("a member thread crashed on the RetryLater")
    if st != {"dead": 1}:
        problems.append(f"row states {st}, expected {{'dead': 1}}")
    verdict(problems, "a RetryLater with a non-numeric delay is a message failure")
