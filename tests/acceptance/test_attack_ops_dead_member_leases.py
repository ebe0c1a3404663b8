"""Attack (issue 21, decision 0030): a consumer killed while it held every row.

A member claims the group's rows and is killed (SIGKILL: no clean leave, no
release). Its leases run out; no member is left to sweep them, so the rows stay
`leased` forever and nothing is claimable by the only measure `pgq check` and
the views look at (the oldest row in state `ready`). The group is stalled — a
dead consumer, the first case decision 0030 lists — yet `pgq check` says OK
and `pgq status` says nothing.
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess

import pytest
from helpers import PGQ, consumer_env, read_ids, reap, spawn_pgq, wait_until
from sqlalchemy import Engine, func, update

import pgq
from pgq import schema as t

pytestmark = pytest.mark.slow

GROUP = "billing"


def test_a_killed_member_whose_leases_ran_out_long_ago_is_a_stall(
    orders: Engine, pgq_env, tmp_path
):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])
    env = consumer_env(
        pgq_env,
        tmp_path,
        PGQ_WORKERS=8,
        PGQ_LEASE=1,
        PGQ_BREAKER_HEARTBEAT=0.2,
        PGQ_BREAKER_MEMBER_TTL=1,
        PGQ_POLL_INTERVAL=0.1,
    )
    proc = spawn_pgq(env, "consume", GROUP, "--handler", "handlers:gated", "--name", "victim")
    try:
        wait_until(lambda: len(read_ids(tmp_path, "started")) == 3, 30, "every row started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        reap(proc)
    wait_until(
        lambda: not any(m["live"] for m in pgq.status(orders, GROUP)["members"]),
        15,
        "the killed member no longer live",
    )
    # the kill was two hours ago: its leases ran out then (as `age` in test_stalls
    # moves `available_at` back, by the database clock)
    d = t.delivery
    with orders.begin() as conn:
        conn.execute(
            update(d)
            .where(d.c.message_id.in_(ids))
            .values(lease_expires_at=func.now() - dt.timedelta(hours=2))
        )
    status = pgq.status(orders, GROUP)
    assert status["counts"]["leased"] == 3 and status["counts"]["ready"] == 0

    check = subprocess.run(
        [*PGQ, "check", GROUP], env=pgq_env, capture_output=True, text=True, timeout=60
    )
    text = subprocess.run(
        [*PGQ, "status", GROUP], env=pgq_env, capture_output=True, text=True, timeout=60
    )
    assert check.returncode != 0, (
        f"pgq check is green on a group whose only member died holding every row: {check.stdout!r}"
    )
    assert "stalled" in text.stdout, text.stdout
