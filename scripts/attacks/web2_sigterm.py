"""`pgq web` and `pgq demo --web` stopped by SIGTERM (what systemd, Docker and
Kubernetes send) or SIGHUP (the terminal closed).

Before the fix neither command handled them: the default action killed the
process at once, so `pgq web` exited -15 with its requests in flight cut off
(clients got `RemoteDisconnected`; a requeue could commit with no answer), and
`pgq demo --web` exited -15 leaving its scratch schema `pgq_demo_*` in the
database for good. Ctrl-C (SIGINT) already stopped both cleanly.

Expected: exit 0 (`pgq web`), every request in flight answered, no traceback;
the demo's scratch schema dropped. Exits 1 while the defect exists.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import psycopg
from _common import DSN, PGQ, Schema
from _web import request

import pgq


def demo_schemas() -> set[str]:
    with psycopg.connect(DSN) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'pgq\\_demo\\_%'"
        ).fetchall()
    return {r[0] for r in rows}


def web(s: Schema, sig: signal.Signals) -> list[str]:
    proc = subprocess.Popen(
        [PGQ, "web", "--port", "0"],
        env=s.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    found = re.search(r"(http://\S+/) ", proc.stderr.readline())
    assert found, "pgq web printed no URL"
    url = found.group(1)
    answers: list[object] = []

    def browse() -> None:
        try:
            answers.append(request(url, "GET", "/groups/g", timeout=20).status)
        except OSError as exc:
            answers.append(type(exc).__name__)

    threads = [threading.Thread(target=browse) for _ in range(8)]
    for th in threads:
        th.start()
    time.sleep(0.05)  # the requests are in flight
    proc.send_signal(sig)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    for th in threads:
        th.join(30)
    err = proc.stderr.read()
    problems = []
    if code != 0:
        problems.append(f"pgq web on {sig.name}: exit {code} (want 0)")
    if any(a != 200 for a in answers):
        problems.append(f"pgq web on {sig.name}: requests in flight answered {answers}")
    if "Traceback" in err:
        problems.append(f"pgq web on {sig.name}: a traceback:\n{err}")
    return problems


def demo(sig: signal.Signals) -> list[str]:
    before = demo_schemas()
    proc = subprocess.Popen(
        [PGQ, "demo", "--web", "--port", "0", "--dsn", DSN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("dashboard:"):
            break
    time.sleep(1.0)  # the story runs
    proc.send_signal(sig)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    err = proc.stderr.read() if proc.stderr else ""
    left = demo_schemas() - before
    problems = []
    if left:
        problems.append(f"pgq demo --web on {sig.name}: exit {code}, left {sorted(left)} behind")
        with psycopg.connect(DSN, autocommit=True) as conn:
            for name in left:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    if code is None or code < 0:
        problems.append(f"pgq demo --web on {sig.name}: killed (exit {code})")
    if "Traceback" in err:
        problems.append(f"pgq demo --web on {sig.name}: a traceback:\n{err}")
    return problems


def main() -> int:
    s = Schema("web2_sigterm")
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        problems = web(s, signal.SIGTERM) + web(s, signal.SIGHUP) + demo(signal.SIGTERM)
    finally:
        s.close()
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print("held: SIGTERM/SIGHUP stop pgq web cleanly (exit 0) and the demo drops its schema")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
