"""Attack (issue 21, DESIGN §7, the logs paragraph): "SIGHUP stops `pgq consume`
like SIGTERM".

`pgq consume` installs its handler for SIGTERM and SIGINT only
(`pgq.cli.consume.install_signal_handlers`), so SIGHUP — a closed terminal, an
ssh session that drops, `systemctl reload`, a supervisor's "reload" — keeps
Python's default action and kills the member at once: exit 129, no graceful
stop, no `member left`, no run summary, its leases held until they expire.
"""

from __future__ import annotations

import signal

import pytest
from helpers import consumer_env, finish, reap, spawn_pgq, wait_until

import pgq

pytestmark = pytest.mark.slow


def test_sighup_stops_a_member_like_sigterm(orders, pgq_env, tmp_path):
    env = consumer_env(
        pgq_env,
        tmp_path,
        PGQ_POLL_INTERVAL=0.1,
        PGQ_BREAKER_HEARTBEAT=0.2,
        PGQ_BREAKER_MEMBER_TTL=1.0,
    )
    proc = spawn_pgq(env, "consume", "billing", "--handler", "handlers:record", "--name", "m1")
    try:
        wait_until(
            lambda: any(m["live"] for m in pgq.status(orders, "billing")["members"]),
            30,
            "the member to join",
        )
        proc.send_signal(signal.SIGHUP)
        code, _, err = finish(proc, 60)
    finally:
        reap(proc)
    assert code == 0, f"pgq consume exited {code} on SIGHUP:\n{err}"
    assert "stopping on signal=SIGHUP" in err and "member left" in err, err
