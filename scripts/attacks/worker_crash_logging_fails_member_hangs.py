"""A worker crash whose own logging fails leaves the member running with no worker:
`pgq consume --until-empty` never returns and the row's lease is extended forever.

What it shows: the handler raises an exception whose `__getattr__` raises KeyError for
every missing attribute (dunders included). The classifier's `getattr(exc, "sqlstate")`
raises inside `Handling.run` (defect of handler_error_getattr_crashes_member.py); then
`Role.run` calls `member.crash()`, whose `logger.exception` itself fails while formatting
the traceback (traceback reads `__notes__` -> KeyError). The exception escapes
`member.crash()` before `request_stop()`, the worker thread dies silently ("Exception in
thread pgq-worker-1"), and nothing stops the member: the fetcher, heartbeat and lease
extension go on; the row stays `leased` by a live member, so no other member reclaims it.

Expected: the attempt is a `message` failure (row `dead` with max_attempts=1) and the run
exits 0; at the very least a crashed thread must stop the member (exit 1) whatever its
logging does. Actual: the process runs until killed (here: 25 s), the row stays leased.
Severity: stalled (forever, while the process lives).

Run: .venv/bin/python scripts/attacks/worker_crash_logging_fails_member_hangs.py (~30 s)
Exit 0 once fixed, 1 while the defect exists.
"""

from _common import Schema, states, verdict

import pgq

with Schema("crashhang") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish(s.engine, "t", {"n": 1})
    r = s.pgq(
        "consume",
        "g",
        "--handler",
        "attack_handlers:raw_rpc_error",
        "--until-empty",
        "--workers",
        "1",
        timeout=25,
        PGQ_MAX_ATTEMPTS="1",
        PGQ_BREAKER_MIN_MEMBERS="9",
    )
    st = states(s, "g")
    problems = []
    if r.returncode is None:
        problems.append("pgq consume --until-empty did not exit within 25 s (member hangs)")
    elif r.returncode != 0:
        problems.append(f"pgq consume exited {r.returncode}")
    if st != {"dead": 1}:
        problems.append(f"row states {st}, expected {{'dead': 1}}")
    verdict(problems, "a handler exception that breaks traceback printing does not hang the member")
