"""Lease tokens near the bound of decision 0004: a block value v must stay below
2^43 (v * 2^20 + k must fit a bigint). What happens at and past the bound, with
real `pgq consume` processes?

1. `lease_token` set so the next value is 2^43 - 1 (the last valid block): a member
   claims, its tokens are -(2^63 - 1 - (2^20 - 1 - k)); acks must apply.
2. Inside one process, the block at 2^43 - 1 used up to its last token (k = 2^20 - 1:
   the token -(2^63 - 1)) and then the next claim: it needs a new block.
3. The sequence past the bound (an earlier version ran the sequence up there, or
   several blocks were drawn since): a today's `pgq consume --until-empty` and an
   earlier-version process (6490a38 at TOKEN2_PREV, default /tmp/pgq_prev2) on
   the same group.

Run: .venv/bin/python scripts/attacks/token2_sequence_bound.py (~30 s)
Prints what each step observed; exit 1 when today's consumer cannot consume.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from _common import DSN, Schema, states, verdict

import pgq
from pgq.records import Outcome
from pgq.store.group import TOKEN_BITS, GroupStore
from pgq.store.topics import group_info

PREV = Path(os.environ.get("TOKEN2_PREV", "/tmp/pgq_prev2")).resolve()
BOUND = 1 << (63 - TOKEN_BITS)
problems: list[str] = []

with Schema("t2bound") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    gid = group_info(s.engine, "g").id
    seq = f'"{s.name}".lease_token'

    # 1 + 2: the last valid block, used up to its last token, then one more claim
    s.sql(f"SELECT setval('{seq}', {BOUND - 2})")
    pgq.publish_many(s.engine, "t", [{"n": i} for i in range(3)])
    store = GroupStore(gid, "g", "t", "a", 30.0, 3)
    with s.engine.begin() as c:
        first = store.claim(c, 1, 0)
    print("step 1: block", store.tokens._block, "token", first[0].seq, "(2^43-1 block)")
    with s.engine.begin() as c:
        print("  ack applied", store.record(c, [Outcome(first[0], "done")]))
    store.tokens._next = (1 << TOKEN_BITS) - 1  # as after 2^20 - 2 more claims
    with s.engine.begin() as c:
        last = store.claim(c, 1, 0)
    print(
        "step 2: last token of the block", last[0].seq, "== -(2^63-1):", last[0].seq == -(2**63 - 1)
    )
    with s.engine.begin() as c:
        print("  ack applied", store.record(c, [Outcome(last[0], "done")]))
    try:
        with s.engine.begin() as c:
            nxt = store.claim(c, 1, 0)
        print("  next claim:", nxt)
    except Exception as exc:
        print(f"  next claim raised {type(exc).__name__}: {exc}")

    # 3: real processes past the bound
    pgq.publish_many(s.engine, "t", [{"n": i} for i in range(20)])
    print("sequence now at", s.sql(f"SELECT last_value FROM {seq}")[0][0], "bound", BOUND)
    t0 = time.monotonic()
    r = s.pgq(
        "consume",
        "g",
        "--handler",
        "builtins:id",
        "--until-empty",
        "--name",
        "today",
        PGQ_LEASE="2",
        timeout=25,
    )
    took = time.monotonic() - t0
    print(f"step 3: today's `pgq consume --until-empty`: rc={r.returncode} after {took:.1f}s")
    print("  stderr:", "\n  ".join(r.stderr.strip().splitlines()[-40:]))
    print("  states", states(s, "g"))
    if r.returncode != 0 or states(s, "g").get("ready"):
        problems.append(
            f"past the bound today's consumer consumes nothing: rc={r.returncode},"
            f" states {states(s, 'g')} (stderr: {r.stderr.strip().splitlines()[-1:]})"
        )
    if (PREV / "pgq").exists():
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
        env.update(PGQ_DSN=DSN, PGQ_SCHEMA=s.name, PYTHONPATH=str(PREV))
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "from pgq.cli import main; main()",
                "consume",
                "g",
                "--handler",
                "builtins:id",
                "--until-empty",
                "--name",
                "earlier",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=40,
            cwd="/tmp",
        )
        print(f"  the earlier version on the same group: rc={r.returncode}; states", states(s, "g"))
        print("  its stderr:", "\n  ".join(r.stderr.strip().splitlines()[-8:]))

verdict(problems, "lease tokens past the 2^43 block bound")
