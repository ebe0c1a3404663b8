"""A handler error whose `__getattr__` raises KeyError crashes the whole member.

What it shows: the default classifier reads `getattr(exc, "sqlstate", None)`, which only
swallows AttributeError. A user exception class that forwards attribute reads to a payload
dict (`__getattr__` -> `self.payload[name]` -> KeyError, a very common pattern for RPC/API
error wrappers) makes `Handling.run` raise, the worker thread dies, and the whole member
stops ("thread crashed ... stopping"). The row stays `leased`; after the lease expires the
next member that reclaims it crashes too (a poison message that takes down every consumer
until `max_reclaims` kills it as `lease`).

Expected (DESIGN §4 "Nothing a handler returns or raises can crash the acker", §5 "raises
anything else -> message"): the attempt fails as `message`; with max_attempts=1 the row
is `dead` (message) and `pgq consume --until-empty` exits 0 with stop_reason=empty.
Actual: exit 1 (thread crashed), row left `leased`.

Run: .venv/bin/python scripts/attacks/handler_error_getattr_crashes_member.py  (~5 s)
Exit 0 once fixed, 1 while the defect exists.
"""

from _common import Schema, states, verdict

import pgq

with Schema("getattr") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish(s.engine, "t", {"n": 1})
    r = s.pgq(
        "consume",
        "g",
        "--handler",
        "attack_handlers:rpc_error",
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
        problems.append(
            f"pgq consume exited {r.returncode}; stderr tail: {r.stderr.strip().splitlines()[-1:]}"
        )
    if "thread crashed" in r.stderr:
        problems.append("a member thread crashed on the handler's exception")
    if st != {"dead": 1}:
        problems.append(f"row states {st}, expected {{'dead': 1}} (a message failure)")
    verdict(problems, "a handler exception with a raising __getattr__ is a message failure")
