"""Where `pgq consume --metrics-port` listens (issue 21, DESIGN §7): on 127.0.0.1
unless `--metrics-host` says otherwise (it listened on every interface), and what it
serves beyond the counts: the latency histograms and the rows in flight.

127.0.0.2 stands for "another address of this machine": Linux routes all of
127.0.0.0/8 to the loopback interface, so a socket bound to every interface answers
there and one bound to 127.0.0.1 does not. Every test runs the real `pgq` command.
"""

from __future__ import annotations

import signal
import socket
import urllib.request

import pytest
from helpers import assert_usage_error, consumer_env, finish, spawn_pgq, wait_until

import pgq

pytest.importorskip("prometheus_client")

FAST_ENV = {
    "PGQ_LEASE": "1.0",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_POLL_INTERVAL": "0.1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(host: str, port: int) -> dict[str, float] | None:
    """The samples of `http://host:port/metrics` by name (and `le` for buckets), or
    None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as resp:
            body = resp.read().decode()
    except OSError:
        return None
    samples: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if name.endswith("_bucket"):
                name += "@" + name_labels.split('le="', 1)[1].split('"', 1)[0]
            samples[name] = float(value)
    return samples


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def serve(pgq_env, tmp_path, procs, port: int, *host: str):
    proc = spawn_pgq(
        consumer_env(pgq_env, tmp_path, **FAST_ENV),
        *("consume", "billing", "--handler", "handlers:record", "--metrics-port", str(port)),
        *host,
    )
    procs.append(proc)
    return proc


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    assert code == 0, err
    assert "Traceback" not in err


def test_metrics_listen_on_loopback_by_default(orders, pgq_env, tmp_path, procs):
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(5)])
    port = free_port()
    proc = serve(pgq_env, tmp_path, procs, port)

    def drained() -> dict[str, float] | None:
        if proc.poll() is not None:
            raise AssertionError(f"pgq consume exited {proc.returncode}: {proc.stderr.read()}")
        found = scrape("127.0.0.1", port)
        return found if found and found.get("pgq_group_lag") == 0 else None

    found = wait_until(drained, 30, "the metrics to report no lag")
    assert refused("127.0.0.2", port)  # not on every interface
    # the handler histogram counts every run; claims and outcome writes were timed
    assert found["pgq_handler_duration_seconds_count"] == 5
    assert found["pgq_handler_duration_seconds_bucket@+Inf"] == 5
    assert found["pgq_claim_duration_seconds_count"] >= 1
    assert found["pgq_ack_duration_seconds_count"] >= 1
    assert found["pgq_in_flight_messages"] == 0
    stop(proc)


def test_metrics_host_chooses_the_address(orders, pgq_env, tmp_path, procs):
    port = free_port()
    proc = serve(pgq_env, tmp_path, procs, port, "--metrics-host", "127.0.0.2")

    def answering() -> dict[str, float] | None:
        if proc.poll() is not None:
            raise AssertionError(f"pgq consume exited {proc.returncode}: {proc.stderr.read()}")
        found = scrape("127.0.0.2", port)
        return found if found and "pgq_group_lag" in found else None  # once it read them

    assert "pgq_group_lag" in wait_until(answering, 30, "the metrics on 127.0.0.2")
    assert refused("127.0.0.1", port)
    stop(proc)


def test_metrics_host_without_a_port_is_a_usage_error(orders, pgq_env, tmp_path):
    env = consumer_env(pgq_env, tmp_path, **FAST_ENV)
    proc = spawn_pgq(
        env,
        *("consume", "billing", "--handler", "handlers:record", "--until-empty"),
        *("--metrics-host", "0.0.0.0"),
    )
    code, _, err = finish(proc, 30)
    assert_usage_error(code, err, contains="--metrics-host needs --metrics-port")


def test_a_metrics_host_that_is_not_here_is_one_line_and_exit_2(orders, pgq_env, tmp_path):
    env = consumer_env(pgq_env, tmp_path, **FAST_ENV)
    port = free_port()
    proc = spawn_pgq(
        env,
        *("consume", "billing", "--handler", "handlers:record", "--until-empty"),
        *("--metrics-port", str(port), "--metrics-host", "192.0.2.1"),  # TEST-NET-1
    )
    code, _, err = finish(proc, 30)
    assert_usage_error(code, err, contains="--metrics-host 192.0.2.1")
