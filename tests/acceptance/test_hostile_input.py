"""Hostile or careless input cannot hurt (issue 21): a setting that defeats its own
purpose, a config file that never ends, a secret in the DSN, a signal at any moment.

Every test runs the real `pgq` command (a subprocess, or click's runner where no
signal or process matters) and bounds it in time.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import (
    PGQ,
    assert_usage_error,
    consumer_env,
    finish,
    invoke,
    read_ids,
    rows,
    spawn_pgq,
    wait_until,
)

import pgq


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("PGQ_LEASE", "0.01", "PGQ_LEASE in the environment: '0.01' (must be at least 1 second)"),
        ("PGQ_POLL_INTERVAL", "1ms", "(must be at least 0.05 seconds)"),
        ("PGQ_BREAKER_HEARTBEAT", "0.001", "(must be at least 0.1 seconds)"),
        ("PGQ_RETENTION", "1s", "(must be at least 60 seconds)"),
    ],
)
def test_a_duration_below_its_bound_stops_consume_with_one_line(pgq_env, variable, value, words):
    """Reported: `lease = 0.01` was accepted and a lone member dead-lettered its own rows."""
    result = invoke(
        pgq_env, "consume", "billing", "--handler", "handlers:record", **{variable: value}
    )
    assert_usage_error(result.exit_code, result.output, contains=words)


# -- config files that never end -----------------------------------------------------


def _limit_memory() -> None:
    """In the child: at most 1 GiB of address space, so a file read whole fails fast."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "big"])
def test_a_config_file_that_never_ends_is_one_line_and_exit_2(pgq_env, tmp_path, kind):
    """Reported: `--config /dev/zero` grew to ~4 GB in 6 s."""
    if kind == "/dev/zero":
        path = kind
    elif kind == "fifo":
        path = str(tmp_path / "pgq.toml")
        os.mkfifo(path)
    else:
        path = str(tmp_path / "pgq.toml")
        with open(path, "wb") as fp:
            fp.truncate(2 << 30)  # 2 GiB, sparse
    started = time.monotonic()
    done = subprocess.run(
        [*PGQ, "--config", path, "consume", "billing", "--handler", "handlers:record"],
        env=pgq_env,
        capture_output=True,
        text=True,
        timeout=15,
        preexec_fn=_limit_memory,
    )
    assert time.monotonic() - started < 10
    reason = "larger than 1 MiB" if kind == "big" else "not a regular file"
    assert_usage_error(done.returncode, done.stderr, contains=f"{path}: {reason}")


# -- secrets in the DSN --------------------------------------------------------------


def _dead_port() -> int:
    """A local port where nothing listens (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# (DSN with {port}, the secrets in it, whether libpq can read it as written)
HOSTILE_DSNS = [
    ("postgresql://pgq:s3cr@t-ONE@127.0.0.1:{port}/db", ["s3cr", "t-ONE"], False),
    ("postgresql://us@er-TWO:pw-TWO@127.0.0.1:{port}/db", ["er-TWO", "pw-TWO"], False),
    ("postgresql://pgq:pw/FIVE@127.0.0.1:{port}/db", ["FIVE"], False),
    ("host=127.0.0.1 port={port} user=pgq password=pw-THREE dbname=db", ["pw-THREE"], True),
    ("postgresql://pgq:pw%40FOUR@127.0.0.1:{port}/db", ["pw@FOUR", "pw%40FOUR", "FOUR"], True),
    ("postgresql://127.0.0.1:{port}/db?user=pgq&password=pw-SIX", ["pw-SIX"], True),
]


def _assert_no_secret(secrets: list[str], text: str) -> None:
    for secret in secrets:
        assert secret not in text, text


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize(("dsn", "secrets", "readable"), HOSTILE_DSNS)
def test_status_and_check_never_print_the_secrets_of_a_dsn(
    pgq_env, dsn, secrets, readable, log_format
):
    """Reported: with a raw `@` in the password, `pgq status` and `pgq check` printed the
    part after it as the "host"."""
    dsn = dsn.format(port=_dead_port())
    status = invoke(pgq_env, "--log-format", log_format, "--dsn", dsn, "status")
    assert status.exit_code == 2, status.output
    _assert_no_secret(secrets, status.output)
    check = invoke(pgq_env, "--log-format", log_format, "--dsn", dsn, "check", "billing")
    assert check.exit_code == 3, check.output
    _assert_no_secret(secrets, check.output)
    error_start = "pgq: error: " if log_format == "text" else '{"time": '
    for output, start in ((status.output, error_start), (check.output, "UNKNOWN: ")):
        # a password in --dsn is warned about first (a log line; see below)
        [line] = [x for x in output.splitlines() if "password on the command line" not in x]
        assert line.startswith(start)
        if start == error_start and log_format == "json":  # one JSON object, exit 2
            assert json.loads(line)["exit_code"] == 2, line
        if readable:  # the address is described, as libpq read it
            assert "host=127.0.0.1" in line
        else:
            assert "must be percent-encoded" in line


@pytest.mark.parametrize(("dsn", "secrets", "readable"), HOSTILE_DSNS)
def test_consume_retries_never_print_the_secrets_of_a_dsn(
    pgq_env, tmp_path, procs, dsn, secrets, readable
):
    """Reported: every retry warning of `consume --until-empty` printed them too, in text
    and JSON logs."""
    env = consumer_env(pgq_env, tmp_path, PGQ_LEASE="1", PGQ_DSN=dsn.format(port=_dead_port()))
    runs = {
        log_format: spawn_pgq(
            env,
            *("--log-format", log_format, "consume", "billing"),
            *("--handler", "handlers:record", "--until-empty"),
        )
        for log_format in ("text", "json")
    }
    procs.extend(runs.values())
    for log_format, proc in runs.items():
        code, out, err = finish(proc, timeout=30)
        _assert_no_secret(secrets, out + err)
        if readable:  # it tried for `lease` seconds, warning at each retry, and gave up
            assert code == 75, err
            retries = [line for line in err.splitlines() if "retrying" in line]
            assert retries, err
            assert all("host=127.0.0.1" in line for line in retries), err
            if log_format == "json":
                assert all(json.loads(line)["level"] == "WARNING" for line in retries)
        elif log_format == "json":  # the error is one JSON object (DESIGN §7)
            [line] = err.splitlines()
            event = json.loads(line)
            assert (code, event["exit_code"]) == (2, 2), err
            assert "must be percent-encoded" in event["error"], err
        else:
            assert_usage_error(code, err, contains="must be percent-encoded")


# -- signals at any moment ---------------------------------------------------------------

CONSUME_ENV = {
    "PGQ_LEASE": "30",
    "PGQ_SHUTDOWN_GRACE": "10",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_POLL_INTERVAL": "0.1",
}


def test_sighup_stops_consume_like_sigterm(orders, pgq_env, tmp_path, procs):
    """Reported: SIGHUP killed `pgq consume` (exit 129) and its leases had to expire."""
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(20)])
    env = consumer_env(pgq_env, tmp_path, TESTQ_TAG="a", **CONSUME_ENV)
    a = spawn_pgq(env, "consume", "billing", "--handler", "handlers:gated", "--workers", "2")
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 2, 15, "two handlers running")
    leased = lambda: [m for m, r in rows(orders, "billing").items() if r.state == "leased"]  # noqa: E731
    wait_until(lambda: len(leased()) > 2, 10, "rows buffered besides the running two")

    a.send_signal(signal.SIGHUP)
    wait_until(lambda: len(leased()) == 2, 5, "the unstarted rows released at once")
    (tmp_path / "go").touch()
    code, _, stderr = finish(a, 20)
    assert code == 0, stderr
    assert "stop_reason=signal" in stderr
    assert leased() == []
    assert len(read_ids(tmp_path, "handled")) == 2


def _importing(pid: int) -> bool:
    """Whether process `pid` has started loading SQLAlchemy's compiled modules (the
    heavy imports every `pgq` command runs before its own code)."""
    try:
        return "sqlalchemy" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True  # it is gone: let the test look at how it ended


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_during_start_up_is_one_line_and_exit_0(orders, pgq_env, tmp_path, procs, signum):
    """Known weak spot: SIGTERM while `pgq consume` was still importing ended it with
    -15 (SIGINT: a traceback), as its handlers came after the heavy imports."""
    env = consumer_env(pgq_env, tmp_path, **CONSUME_ENV)
    proc = spawn_pgq(env, "consume", "billing", "--handler", "handlers:record", "--until-empty")
    procs.append(proc)
    wait_until(lambda: _importing(proc.pid), 15, "the imports to begin", interval=0.001)
    proc.send_signal(signum)
    code, stdout, stderr = finish(proc, 15)
    assert (code, stdout) == (0, ""), stderr
    assert stderr == f"pgq: stopped by {signal.Signals(signum).name}\n"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_stop_during_start_up_is_one_json_line_with_json_logs(
    orders, pgq_env, tmp_path, procs, how
):
    """With `--log-format json` (or $PGQ_LOG_FORMAT) every line on stderr is one JSON
    object (DESIGN §7): the start-up stop's too, though click has not read the flag."""
    env = consumer_env(pgq_env, tmp_path, **CONSUME_ENV)
    args = ["consume", "billing", "--handler", "handlers:record", "--until-empty"]
    if how == "flag":
        args = ["--log-format", "json", *args]
    else:
        env["PGQ_LOG_FORMAT"] = "json"
    proc = spawn_pgq(env, *args)
    procs.append(proc)
    wait_until(lambda: _importing(proc.pid), 15, "the imports to begin", interval=0.001)
    proc.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(proc, 15)
    assert (code, stdout) == (0, ""), stderr
    [line] = stderr.splitlines()
    event = json.loads(line)
    assert event["message"] == "stopped" and event["signal"] == "SIGTERM", event
    assert event["level"] == "WARNING"


def test_a_stop_while_the_handler_module_imports_is_one_line_and_exit_0(
    orders, pgq_env, tmp_path, procs
):
    """A handler module that takes long to import (a big framework) is start-up too."""
    (tmp_path / "slowimport.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(tmp_path / 'importing')!r}).touch()\n"
        "time.sleep(60)\n"
        "def handle(msg): pass\n"
    )
    env = consumer_env(pgq_env, tmp_path, **CONSUME_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = spawn_pgq(env, "consume", "billing", "--handler", "slowimport:handle")
    procs.append(proc)
    wait_until((tmp_path / "importing").exists, 15, "the handler module to import")
    proc.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(proc, 15)
    assert (code, stdout, stderr) == (0, "", "pgq: stopped by SIGTERM\n")


def test_a_stop_that_cuts_a_command_short_is_one_line_and_exit_1(pgq_env, procs):
    """Any other command stopped halfway (here waiting for a server that never answers)
    ends with one line and exit 1: it did not do what it was asked."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        dsn = f"postgresql://pgq@127.0.0.1:{silent.getsockname()[1]}/db?connect_timeout=30"
        proc = spawn_pgq(pgq_env, "--dsn", dsn, "status")
        procs.append(proc)
        silent.settimeout(15)
        conn, _ = silent.accept()  # it is in the command, connecting
        with conn:
            proc.send_signal(signal.SIGTERM)
            code, stdout, stderr = finish(proc, 15)
    assert (code, stdout, stderr) == (1, "", "pgq: stopped by SIGTERM\n")


# -- a password on the command line --------------------------------------------------------


def test_a_password_in_a_dsn_flag_is_warned_about_once(orders, pgq_env):
    """Reported: `--dsn` is visible in `ps` to every user. pgq cannot hide its own
    command line, so it says so (a log line) and the docs say what to use instead."""
    dsn = psycopg.conninfo.make_conninfo(pgq_env["PGQ_DSN"], password="hunter2-SEVEN")
    env = {k: v for k, v in pgq_env.items() if k != "PGQ_DSN"}
    runs = {
        "flag": subprocess.run(
            [*PGQ, "--dsn", dsn, "--session-dsn", dsn, "status"], env=env, **RUN
        ),
        "json": subprocess.run(
            [*PGQ, "--log-format", "json", "--dsn", dsn, "status"], env=env, **RUN
        ),
        "env": subprocess.run([*PGQ, "status"], env={**env, "PGQ_DSN": dsn}, **RUN),
        "no password": subprocess.run(
            [*PGQ, "--dsn", pgq_env["PGQ_DSN"], "status"], env=env, **RUN
        ),
    }
    for how, done in runs.items():
        assert done.returncode == 0, (how, done.stderr)
        assert "hunter2-SEVEN" not in done.stdout + done.stderr
        assert "billing  orders" in done.stdout, (how, done.stdout)
    [line] = runs["flag"].stderr.splitlines()
    assert "WARNING pgq.cli: password on the command line flag=--dsn,--session-dsn:" in line
    assert "PGQ_DSN" in line
    [line] = runs["json"].stderr.splitlines()
    assert json.loads(line)["flag"] == "--dsn"
    assert runs["env"].stderr == runs["no password"].stderr == ""


RUN: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 30}
