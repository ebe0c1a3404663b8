"""Attack (issue 21, decision 0032): the progress line while the network to the
database stalls.

The progress line exists to say, once a minute, that a member is alive, with
`lag` null "when the database did not answer". It is a task of the maintenance
thread, and its `lag` is a statement on the maintenance connection with no
deadline: when the route to the database stops answering (a blackholed network,
a moved virtual IP; the chaos proxy's `stall`), that statement waits for as
long as TCP keeps the socket, and no progress line comes at all — the member
goes silent exactly when an operator needs to know it is alive.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from chaos.proxy import Proxy
from helpers import consumer_env, finish, reap, spawn_pgq, wait_until

pytestmark = pytest.mark.slow

EVERY = 0.5
"""Seconds between progress lines (`TESTQ_PROGRESS_EVERY`)."""


def progress_lines(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if "progress handled=" in line)


def test_progress_lines_keep_coming_while_the_database_does_not_answer(
    orders, pg_dsn, pgq_env, tmp_path
):
    log = tmp_path / "member.log"
    with Proxy.for_dsn(pg_dsn) as proxy:
        env = consumer_env(
            {**pgq_env, "PGQ_DSN": proxy.dsn(pg_dsn)},
            tmp_path,
            TESTQ_PROGRESS_EVERY=EVERY,
            PGQ_POLL_INTERVAL=0.1,
            PGQ_BREAKER_HEARTBEAT=0.2,
            PGQ_BREAKER_MEMBER_TTL=1.5,
        )
        proc = spawn_pgq(env, "consume", "billing", "--handler", "progress_handlers:flaky", log=log)
        try:
            wait_until(lambda: progress_lines(log) >= 2, 30, "the first progress lines")
            proxy.stall()  # every connection stops answering; nothing is closed
            before = progress_lines(log)
            try:
                wait_until(
                    lambda: progress_lines(log) >= before + 3,
                    12 * EVERY + 5,
                    "progress lines while the database does not answer",
                    describe=lambda: log.read_text()[-1500:],
                )
            finally:
                proxy.resume()
            proc.send_signal(signal.SIGTERM)
            finish(proc, 60)
        finally:
            reap(proc)
