"""`pgq consume --metrics-port P` exits 2 at once ("consumer is not running").

What it shows: the Prometheus collector was registered, and so collected, before the
member had joined its group; collecting asked the consumer for its counts, which it
refuses until it runs. Every `--metrics-port` run ended there, so the metrics the README
promises could never be scraped.

Expected (DESIGN §7, README): the member runs and `http://127.0.0.1:P/metrics` serves its
metric families (`pgq_done_total`, `pgq_group_lag`, ...) until SIGTERM, then exit 0.
Actual: exit 2, "pgq: error: consumer is not running", nothing served.

Run: .venv/bin/python scripts/attacks/consume_metrics_port_exits_2.py (~5 s). Exit 0 once
fixed, 1 while the defect exists. Severity: broken feature (no metrics at all).
"""

import signal
import socket
import subprocess
import time
import urllib.request

from _common import PGQ, Schema, verdict

import pgq

problems = []
with Schema("metrics") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish(s.engine, "t", {"n": 1})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [PGQ, "consume", "g", "--handler", "attack_handlers:ok", "--metrics-port", str(port)],
        env=s.env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    body = ""
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline and "pgq_done_total" not in body:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                body = r.read().decode()
        except OSError:
            time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if "pgq_done_total" not in body:
        problems.append("nothing served on /metrics: " + (err.strip().splitlines() or [""])[-1])
    if proc.returncode != 0:
        problems.append(f"exit {proc.returncode} after SIGTERM")
verdict(problems, "pgq consume --metrics-port serves metrics while it runs")
