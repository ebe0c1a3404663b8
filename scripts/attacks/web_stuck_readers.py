"""Connections that stop answering for good keep the dashboard at 503 after the
database is fine again.

What it shows: since d43223f every read runs on one of 4 `pgq-web-read`
threads and a request waits at most `read_timeout` (5 s) for it, then answers
503. The read itself is not cancelled: it stays blocked on its connection.
When the connections the pool holds stop answering for good while new ones
would work (a blackholed route, a NAT or conntrack entry lost, a virtual IP
moved to a new primary, a hung backend: simulated here by SIGSTOP of the
pool's backends on an embedded server of this script's own), four requests
are enough to block all 4 readers, and from then on every request, `/healthz`
included, is a 503 after 5 s: for as long as the dead connections stay blocked
(TCP retransmissions give up after ~15 min by default; a hung backend that
keeps its socket open: never), although a new connection answers at once.

Expected: the dashboard answers 200 again within seconds while the database
takes new connections (reads that time out are abandoned with their
connection; a client-side bound such as libpq's `tcp_user_timeout` and
keepalives, or a statement timeout, frees the reader). Run:
.venv/bin/python scripts/attacks/web_stuck_readers.py (~40 s; its own embedded
server under a temporary $PGQ_HOME, never the shared one). Exit 1 while the
defect exists, 0 once fixed. Severity: stall (monitoring blind after a failover).
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import psycopg
from _common import verdict
from _web import request
from helpers import server_home

import pgq
from pgq import embedded
from pgq.web import dashboard_server

problems: list[str] = []
stopped: list[int] = []
with server_home("pgq-web-stuck-") as home:
    dsn = embedded.ensure_running(home)
    victim = psycopg.conninfo.make_conninfo(dsn, application_name="pgq-web-victim")
    engine = pgq.connect(victim, schema="webstuck")
    pgq.migrate(engine)
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    server = dashboard_server(engine, host="127.0.0.1", port=0)
    server.start()
    try:
        # warm the pool: several connections (concurrent page loads), idle afterwards
        loads = [
            threading.Thread(target=request, args=(server.url, "GET", "/groups/g"))
            for _ in range(8)
        ]
        for th in loads:
            th.start()
        for th in loads:
            th.join(30)
        with psycopg.connect(dsn, autocommit=True) as admin:
            pids = [
                r[0]
                for r in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgq-web-victim'"
                )
            ]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            # the database itself still answers new connections
            assert admin.execute("SELECT 1").fetchone() == (1,)
        print(f"stopped {len(stopped)} backends of the dashboard's pool")
        answers = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            started = time.monotonic()
            status = request(server.url, "GET", "/healthz", timeout=30).status
            answers.append((round(started - t0, 1), status, round(time.monotonic() - started, 1)))
            if status == 200:
                break
        print("(at s, status, took s):", answers)
        if answers[-1][1] != 200:
            problems.append(
                f"/healthz still {answers[-1][1]} {answers[-1][0]} s after the pool's"
                f" connections hung, although new connections answer; answers: {answers[-6:]}"
            )
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        server.close()
        engine.dispose()
verdict(problems, "hung pool connections: /healthz is 200 again within seconds")
