"""Operating `pgq consume` (issue 11): metrics served while it runs, and the
failures that are configuration, not outages — a refused login, a missing
database, a missing privilege — end at once with exit 2 and one line.

Every test runs the real `pgq` command as a subprocess.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
from helpers import consumer_env, finish, spawn_pgq, wait_until

import pgq

FAST_ENV = {
    "PGQ_LEASE": "1.0",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_POLL_INTERVAL": "0.1",
}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started; any still running at the end are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- defect 1: `pgq consume --metrics-port` ---------------------------------------------

METRIC_FAMILIES = {
    # the member's own counts (counters: exposed with `_total`)
    "pgq_handled_total",
    "pgq_done_total",
    "pgq_retried_total",
    "pgq_dead_total",
    "pgq_released_total",
    "pgq_reclaimed_total",
    # the breakers as this member sees them
    "pgq_local_breaker_open",
    "pgq_group_breaker_open",
    # the group's numbers
    "pgq_group_lag",
    "pgq_group_dead_rows",
    "pgq_group_dead_systemic_rows",
    "pgq_group_refunded_rows",
    "pgq_group_check_status",
}


def scrape(port: int) -> dict[str, float] | None:
    """The samples of `http://127.0.0.1:port/metrics` by name, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            body = resp.read().decode()
    except OSError:
        return None
    samples: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            samples[name_labels.split("{", 1)[0]] = float(value)
    return samples


def test_consume_serves_the_metric_families_while_it_runs(orders, pgq_env, tmp_path, procs):
    pytest.importorskip("prometheus_client")
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(5)])
    port = free_port()
    env = consumer_env(pgq_env, tmp_path, **FAST_ENV)
    proc = spawn_pgq(
        env, "consume", "billing", "--handler", "handlers:record", "--metrics-port", str(port)
    )
    procs.append(proc)

    def drained() -> dict[str, float] | None:
        found = scrape(port)
        if proc.poll() is not None:
            raise AssertionError(f"pgq consume exited {proc.returncode}: {proc.stderr.read()}")
        # the member counts a row when it finishes, the group once its outcome is written
        done = found and found.get("pgq_done_total") == 5 and found.get("pgq_group_lag") == 0
        return found if done else None

    found = wait_until(drained, 30, "the metrics endpoint to report 5 done and no lag")
    assert METRIC_FAMILIES <= set(found), METRIC_FAMILIES - set(found)
    assert found["pgq_group_check_status"] == 0
    assert found["pgq_local_breaker_open"] == 0 and found["pgq_group_breaker_open"] == 0
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    assert code == 0, err
    assert "Traceback" not in err


def test_a_metrics_port_in_use_is_one_line_and_exit_2(orders, pgq_env, tmp_path):
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = consumer_env(pgq_env, tmp_path, **FAST_ENV)
        proc = spawn_pgq(
            env,
            *("consume", "billing", "--handler", "handlers:record", "--until-empty"),
            *("--metrics-port", str(port)),
        )
        code, _, err = finish(proc, 30)
    lines = [ln for ln in err.splitlines() if ln.startswith("pgq: error: ")]
    assert code == 2 and len(lines) == 1, err
    assert f"--metrics-port {port}" in lines[0], err
    assert "Traceback" not in err
