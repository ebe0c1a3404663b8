"""`pgq consume` as a real subprocess: draining, crashes, signals, pauses, bad usage.

The handlers live in `tests/handlers.py`; they record what they did in files
under `tmp_path`, so the test sees every process's work. Settings are passed
as `PGQ_*` environment variables, the way a deployment would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    PGQ,
    consumer_env,
    finish,
    pin_frontier,
    read_attempts,
    read_ids,
    rows,
    spawn_pgq,
    wait_until,
)
from sqlalchemy import Engine

import pgq

FAST_ENV = {
    "PGQ_LEASE": "1.0",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_RETRY_BACKOFF": "0.05",
    "PGQ_POLL_INTERVAL": "0.1",
}


def env_for(pgq_env: dict[str, str], out: Path, **extra: object) -> dict[str, str]:
    return consumer_env(pgq_env, out, **{**FAST_ENV, **extra})


def leased_by(engine: Engine, member: str) -> set[int]:
    return {mid for mid, r in rows(engine, "billing").items() if r.lease_owner == member}


def is_live(engine: Engine, member: str) -> bool:
    """Whether `member` counts as live (heartbeat within the test's member_ttl)."""
    ttl = float(FAST_ENV["PGQ_BREAKER_MEMBER_TTL"])
    members = pgq.status(engine, "billing", member_ttl=ttl)["members"]
    return any(m["name"] == member and m["live"] for m in members)


def log_count(log: Path, text: str) -> int:
    return log.read_text().count(text) if log.exists() else 0


def summary_of(stderr: str) -> dict[str, str]:
    """The `handled=... stop_reason=...` line `pgq consume` ends with."""
    [line] = [ln for ln in stderr.splitlines() if ln.startswith("handled=")]
    return dict(word.split("=", 1) for word in line.split())


def cli_status(env: dict[str, str]) -> dict[str, Any]:
    """`pgq status billing --json`."""
    out = subprocess.run(
        [*PGQ, "status", "billing", "--json"], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    status: dict[str, Any] = json.loads(out.stdout)
    return status


def one_error_line(code: int, stderr: str) -> str:
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgq: error: "), stderr
    return lines[0]


# -- 1. draining a backlog -------------------------------------------------------------


def test_until_empty_drains_five_thousand_messages(orders, pgq_env, tmp_path):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(5000)])
    env = consumer_env(pgq_env, tmp_path)
    drain = ("consume", "billing", "--handler", "handlers:record", "--until-empty")
    proc = spawn_pgq(env, *drain, "--workers", "8")
    code, _, stderr = finish(proc, 60)
    exited = time.monotonic()
    assert code == 0, stderr
    assert sorted(read_ids(tmp_path, "handled")) == ids  # every message, each once
    summary = summary_of(stderr)
    assert (summary["done"], summary["stop_reason"]) == ("5000", "empty")

    status = cli_status(pgq_env)
    assert status["counts"]["done"] == 5000
    assert (status["counts"]["ready"], status["counts"]["leased"]) == (0, 0)
    assert status["lag"] == 0
    if status["committed"] != ids[-1]:
        # The run's last pass leaves the frontier current unless a transaction of
        # another session on this (shared) server was open during it: a later
        # run carries it on once that one ends.
        holder = status["frontier_held_by"]
        assert holder and holder["age_s"] >= time.monotonic() - exited, status
        wait_until(
            lambda: (
                finish(spawn_pgq(env, *drain), 30)[0] == 0
                and cli_status(pgq_env)["committed"] == ids[-1]
            ),
            30,
            "a later run to carry the frontier to the last id",
        )


# -- 5. kill -9 ---------------------------------------------------------------------------


def test_rows_of_a_killed_consumer_are_reclaimed_by_another(orders, pgq_env, tmp_path, procs):
    pin = pin_frontier(orders, "orders")  # keep the done rows readable
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(30)])
    # leases outlive the member's liveness: b must wait for them to expire
    lease = {"PGQ_LEASE": "3.0"}
    a = spawn_pgq(
        env_for(pgq_env, tmp_path, TESTQ_TAG="a", **lease),
        *("consume", "billing", "--handler", "handlers:gated", "--workers", "4", "--name", "a"),
    )
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 4, 15, "a to start 4 handlers")
    wait_until(lambda: len(leased_by(orders, "a")) > 4, 10, "a to buffer rows as well")
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    lost = leased_by(orders, "a")
    # `--until-empty` leaves rows of live members alone: start b once a is silent
    wait_until(lambda: not is_live(orders, "a"), 5, "a to stop counting as live")

    # acks of one: each batch keeps its row done, so every message's reclaims stay readable
    b = spawn_pgq(
        env_for(pgq_env, tmp_path, TESTQ_TAG="b", PGQ_BATCH_SIZE="1", **lease),
        *("consume", "billing", "--handler", "handlers:record", "--name", "b", "--until-empty"),
    )
    procs.append(b)
    code, _, stderr = finish(b, 30)
    assert code == 0, stderr

    assert sorted(read_ids(tmp_path, "handled")) == ids  # all by b: a never finished one
    assert read_attempts(tmp_path, "handled") == {mid: [1] for mid in ids}  # a's kill charged none
    found = rows(orders, "billing")
    assert all(found[mid].state == "done" for mid in ids)
    assert all(found[mid].attempts == 1 for mid in ids)
    assert {mid for mid in ids if found[mid].reclaims == 1} == lost
    assert all(found[mid].reclaims == 0 for mid in ids if mid not in lost)
    status = pgq.status(orders, "billing")
    assert status["totals"]["reclaimed"] == len(lost)
    assert status["counts"]["done"] == len(ids)
    assert summary_of(stderr)["reclaimed"] == str(len(lost))
    assert found[pin].state == "ready"


# -- 6. SIGTERM --------------------------------------------------------------------------


def test_sigterm_releases_unstarted_rows_and_exits_cleanly(orders, pgq_env, tmp_path, procs):
    grace = 10.0
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(20)])
    env = env_for(pgq_env, tmp_path, TESTQ_TAG="a", PGQ_SHUTDOWN_GRACE=grace)
    a = spawn_pgq(
        env, *("consume", "billing", "--handler", "handlers:gated", "--workers", "2", "--name", "a")
    )
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 2, 15, "a to start 2 handlers")
    wait_until(lambda: len(leased_by(orders, "a")) > 2, 10, "a to buffer rows as well")
    running = set(read_ids(tmp_path, "started"))

    sent = time.monotonic()
    a.send_signal(signal.SIGTERM)
    # the buffered rows go back at once, while the two handlers still run
    wait_until(lambda: leased_by(orders, "a") == running, 5, "the unstarted rows released")
    (tmp_path / "go").touch()
    code, _, stderr = finish(a, grace + 5)
    assert code == 0, stderr
    assert time.monotonic() - sent < grace

    found = rows(orders, "billing")
    assert not [mid for mid, r in found.items() if r.state == "leased"]
    assert sorted(read_ids(tmp_path, "handled")) == sorted(running)
    released = [mid for mid in ids if mid not in running]
    assert all(found[mid].state == "ready" for mid in released)
    assert all((found[mid].attempts, found[mid].reclaims) == (0, 0) for mid in released)
    status = pgq.status(orders, "billing")
    assert status["counts"]["done"] == len(running)
    assert status["totals"]["released"] == int(summary_of(stderr)["released"]) > 0
    assert status["totals"]["reclaimed"] == 0
    assert summary_of(stderr)["stop_reason"] == "signal"


# -- 8. a paused member comes back too late -----------------------------------------------


def test_a_paused_member_cannot_write_or_extend_rows_it_lost(orders, pgq_env, tmp_path, procs):
    pin_frontier(orders, "orders")  # keep the done rows readable
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    log = tmp_path / "a.log"
    a = spawn_pgq(
        env_for(pgq_env, tmp_path, TESTQ_TAG="a", TESTQ_GATE="go-a"),
        *("-v", "consume", "billing", "--handler", "handlers:gated", "--workers", "4"),
        *("--name", "a"),
        log=log,
    )
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 4, 15, "a to start 4 handlers")
    assert leased_by(orders, "a") == set(ids)
    os.kill(a.pid, signal.SIGSTOP)
    wait_until(lambda: not is_live(orders, "a"), 5, "a to stop counting as live")

    # acks of one: each batch keeps its row done, so a's late writes meet rows, not gaps
    b = spawn_pgq(
        env_for(pgq_env, tmp_path, TESTQ_TAG="b", PGQ_BATCH_SIZE="1"),
        *("consume", "billing", "--handler", "handlers:record", "--name", "b", "--until-empty"),
    )
    procs.append(b)
    code, _, stderr = finish(b, 30)
    assert code == 0, stderr
    assert read_attempts(tmp_path, "handled", "b") == {mid: [1] for mid in ids}
    assert summary_of(stderr)["reclaimed"] == "4"

    def reclaimer_state() -> None:
        found = rows(orders, "billing")
        for mid in ids:
            r = found[mid]
            assert (r.state, r.attempts, r.reclaims) == ("done", 1, 1), r
            assert (r.lease_owner, r.lease_expires_at) == (None, None), r
        # a's refused acks counted nothing (the done count adds the rows acks deleted)
        assert pgq.status(orders, "billing")["counts"]["done"] == len(ids)

    reclaimer_state()
    os.kill(a.pid, signal.SIGCONT)
    # a's handlers still run: its lease extension is refused, and changes nothing
    wait_until(lambda: log_count(log, "leases no longer held"), 10, "a to try extending")
    reclaimer_state()
    (tmp_path / "go-a").touch()
    wait_until(lambda: log_count(log, "outcome refused") == 4, 10, "a's outcomes refused")
    assert len(read_ids(tmp_path, "handled", "a")) == 4  # a did finish its handlers, too late
    reclaimer_state()
    a.send_signal(signal.SIGTERM)
    code, _, _ = finish(a, 15)
    assert code == 0, log.read_text()
    reclaimer_state()
    assert pgq.status(orders, "billing")["totals"]["reclaimed"] == 4


# -- usage errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("handler", ["no_such_module_pgq:handle", "handlers:no_such_function"])
def test_a_handler_that_does_not_import_is_one_line_and_exit_2(orders, pgq_env, tmp_path, handler):
    proc = spawn_pgq(consumer_env(pgq_env, tmp_path), "consume", "billing", "--handler", handler)
    code, _, stderr = finish(proc, 30)
    one_error_line(code, stderr)
    assert rows(orders, "billing") == {}


@pytest.mark.parametrize(
    "body",
    ["import sys\nsys.exit(3)\n", "raise KeyboardInterrupt\n", "raise SystemExit('bye')\n"],
)
def test_a_handler_module_that_exits_on_import_is_one_line_and_exit_2(
    orders, pgq_env, tmp_path, body
):
    """Failed on 16dc802: exit 3 (the module's own code), 1 with 'Aborted!', 1 with 'bye'."""
    (tmp_path / "hostile_handler.py").write_text(body)
    env = consumer_env(pgq_env, tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = spawn_pgq(env, "consume", "billing", "--handler", "hostile_handler:f")
    code, _, stderr = finish(proc, 30)
    assert "cannot import handler module 'hostile_handler'" in one_error_line(code, stderr)
    assert rows(orders, "billing") == {}


def test_an_unknown_group_is_one_line_and_exit_2(orders, pgq_env, tmp_path):
    env = consumer_env(pgq_env, tmp_path)
    proc = spawn_pgq(env, "consume", "no-such-group", "--handler", "handlers:record")
    code, _, stderr = finish(proc, 30)
    assert "no-such-group" in one_error_line(code, stderr)


def test_a_second_live_member_with_the_same_name_is_refused(orders, pgq_env, tmp_path, procs):
    pgq.publish(orders, "orders", {"n": 1})
    env = env_for(pgq_env, tmp_path, TESTQ_TAG="a")
    args = ("consume", "billing", "--handler", "handlers:gated", "--name", "same")
    a = spawn_pgq(env, *args)
    procs.append(a)
    wait_until(lambda: read_ids(tmp_path, "started"), 15, "the first member to run")
    b = spawn_pgq(env, *args)
    procs.append(b)
    code, _, stderr = finish(b, 30)
    assert "same" in one_error_line(code, stderr)
    (tmp_path / "go").touch()
    a.send_signal(signal.SIGTERM)
    code, _, stderr = finish(a, 15)
    assert code == 0, stderr
    assert read_ids(tmp_path, "handled") == read_ids(tmp_path, "started")
