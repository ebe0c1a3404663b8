"""A member is live while its process is (DESIGN §6.2, §7; issue 9 defects 8, 10).

`kill -9` ends the member's database session, and with it the session lock that
makes it live: it stops counting at once, not after `breaker.member_ttl`. These
tests use the default `member_ttl` (10 s), so none of them passes by waiting it out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import (
    FAST,
    consumer_env,
    finish,
    pin_frontier,
    read_ids,
    rows,
    spawn_pgq,
    wait_until,
)
from sqlalchemy import select

import pgq
from pgq import schema as t

ENV = {"PGQ_LEASE": "2.0", "PGQ_BREAKER_HEARTBEAT": "0.2", "PGQ_POLL_INTERVAL": "0.1"}
"""Short leases and heartbeats; `member_ttl` stays at its default, 10 s."""


def member(pgq_env, tmp_path, tag: str, *args: str, **env: str) -> subprocess.Popen[str]:
    env = consumer_env(pgq_env, tmp_path, TESTQ_TAG=tag, **{**ENV, **env})
    return spawn_pgq(env, "consume", "billing", *args)


def summary_of(stderr: str) -> dict[str, str]:
    [line] = [ln for ln in stderr.splitlines() if ln.startswith("handled=")]
    return dict(word.split("=", 1) for word in line.split())


def test_a_killed_member_stops_counting_at_once(orders, pgq_env, tmp_path, procs):
    a = member(pgq_env, tmp_path, "a", "--handler", "handlers:record", "--name", "a")
    procs.append(a)
    wait_until(
        lambda: [m["live"] for m in pgq.status(orders, "billing")["members"]] == [True],
        15,
        "a to join",
    )
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    killed = time.monotonic()
    wait_until(
        lambda: [m["live"] for m in pgq.status(orders, "billing")["members"]] == [False],
        5,
        "a to stop counting",
    )
    assert time.monotonic() - killed < 5  # well inside member_ttl (10 s)


def test_until_empty_right_after_a_kill_finishes_the_victims_rows(orders, pgq_env, tmp_path, procs):
    pin_frontier(orders, "orders")  # keep the done rows readable
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(12)])
    a = member(pgq_env, tmp_path, "a", "--handler", "handlers:gated", "--workers", "4")
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 4, 15, "a to start 4 handlers")
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    held = {mid for mid, r in rows(orders, "billing").items() if r.state == "leased"}
    assert len(held) >= 4  # what a held when it died: its leases must end first

    # acks of one: each batch keeps its row done, so every message's reclaims stay readable
    b = member(
        pgq_env, tmp_path, "b", "--handler", "handlers:record", "--until-empty", PGQ_BATCH_SIZE="1"
    )
    procs.append(b)
    code, _, stderr = finish(b, 30)
    assert code == 0, stderr
    assert summary_of(stderr)["stop_reason"] == "empty"
    assert sorted(read_ids(tmp_path, "handled", "b")) == ids  # a's rows too, once expired
    found = rows(orders, "billing")
    assert all(found[mid].state == "done" for mid in ids)
    assert {mid for mid in ids if found[mid].reclaims == 1} == held


def test_a_member_restarted_under_its_name_right_after_a_kill_starts_at_once(
    orders, pgq_env, tmp_path, procs
):
    args = ("--handler", "handlers:record", "--name", "svc")
    a = member(pgq_env, tmp_path, "a", *args)
    procs.append(a)
    wait_until(
        lambda: [m["live"] for m in pgq.status(orders, "billing")["members"]] == [True],
        15,
        "a to join",
    )
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    pgq.publish(orders, "orders", {"n": 1})
    b = member(pgq_env, tmp_path, "b", *args, "--until-empty")
    procs.append(b)
    code, _, stderr = finish(b, 30)
    assert code == 0, stderr  # not refused as a duplicate for member_ttl
    assert "already running" not in stderr
    assert len(read_ids(tmp_path, "handled", "b")) == 1


def test_a_signal_during_start_up_is_honoured(orders, pgq_env, tmp_path, procs):
    """Defect 8: the database is not there yet; SIGTERM must end the run, not be lost."""
    env = consumer_env({**pgq_env, "PGQ_DSN": "postgresql://postgres@127.0.0.1:1/x"}, tmp_path)
    log = tmp_path / "start.log"
    proc = spawn_pgq(env, "consume", "billing", "--handler", "handlers:record", log=log)
    procs.append(proc)
    wait_until(
        lambda: "database unavailable at start" in log.read_text(), 15, "it to wait for the db"
    )
    proc.send_signal(signal.SIGTERM)
    code, _, _ = finish(proc, 10)
    assert code == 0, log.read_text()
    assert "stop_reason=signal" in log.read_text()


def test_wait_retries_from_the_command_line(orders, pgq_env, tmp_path, procs):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])
    env = consumer_env(pgq_env, tmp_path, **ENV)
    drain = ("consume", "billing", "--handler", "handlers:snooze_once", "--until-empty")
    code, _, stderr = finish(spawn_pgq(env, *drain, "--wait-retries", "10s"), 30)
    assert code == 0, stderr
    assert summary_of(stderr)["waiting_retry"] == "0"
    assert sorted(read_ids(tmp_path, "handled")) == ids

    code, _, stderr = finish(
        spawn_pgq(env, "consume", "billing", "--wait-retries", "5", "--handler", "handlers:record"),
        30,
    )
    assert code == 2, stderr
    assert "--wait-retries needs --until-empty" in stderr

    # 0 waits for nothing, as `run(wait_retries=0)` does (it was refused: "must be > 0")
    code, _, stderr = finish(spawn_pgq(env, *drain, "--wait-retries", "0"), 30)
    assert code == 0, stderr


def test_a_paused_member_whose_name_was_taken_over_stops_when_it_resumes(
    orders, pgq_env, tmp_path, procs
):
    """Found by attack (docs/defects.md): the
    resumed original ran on beside the process that took its name over."""
    short = {"PGQ_BREAKER_MEMBER_TTL": "1.0"}
    args = ("--handler", "handlers:record", "--name", "svc")
    log = tmp_path / "a.log"
    env = consumer_env(pgq_env, tmp_path, TESTQ_TAG="a", **ENV, **short)
    a = spawn_pgq(env, "consume", "billing", *args, log=log)
    procs.append(a)
    wait_until(lambda: "member joined" in log.read_text(), 15, "a to join")
    os.kill(a.pid, signal.SIGSTOP)
    try:
        # a paused member stops counting once its heartbeat is older than member_ttl
        wait_until(
            lambda: (
                [m["live"] for m in pgq.status(orders, "billing", member_ttl=1.0)["members"]]
                == [False]
            ),
            10,
            "a to stop counting",
        )
        b_env = consumer_env(pgq_env, tmp_path, TESTQ_TAG="b", **ENV, **short)
        b_log = tmp_path / "b.log"
        b = spawn_pgq(b_env, "consume", "billing", *args, log=b_log)
        procs.append(b)
        # a's session still holds its lock: b takes the name over from the silent row
        wait_until(lambda: "member joined" in b_log.read_text(), 20, "b to take the name over")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    code, _, _ = finish(a, 15)
    assert "member name taken over" in log.read_text()
    assert code == 0, log.read_text()
    assert b.poll() is None  # b runs on, alone under the name
    wait_until(
        lambda: (
            [(m["name"], m["live"]) for m in pgq.status(orders, "billing")["members"]]
            == [("svc", True)]
        ),
        10,
        "svc to be live (b) after a left",
    )
    pgq.publish(orders, "orders", {"n": 1})
    wait_until(lambda: read_ids(tmp_path, "handled", "b"), 10, "b to handle a message")
    b.send_signal(signal.SIGTERM)
    assert finish(b, 15)[0] == 0


def test_until_empty_sees_a_member_killed_between_its_reads_as_gone(
    orders, pgq_env, tmp_path, procs, monkeypatch
):
    """The drain reads who holds a lock, then counts what is left: a member `kill -9`ed
    between the two counted as live, and the run ended `empty` with the victim's rows
    still leased. Here the kill falls exactly there (after the drain's read of the
    holders); the run must wait for the victim's leases to end and finish its rows."""
    from pgq.store import membership

    pin_frontier(orders, "orders")  # keep the done rows readable
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    a = member(pgq_env, tmp_path, "a", "--handler", "handlers:gated", "--workers", "4")
    procs.append(a)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 4, 15, "a to start 4 handlers")
    real = membership.lock_holders
    killed: list[int] = []

    def holders_then_kill(conn, gid, purpose, **bounds):
        found = real(conn, gid, purpose, **bounds)
        draining = sys._getframe(1).f_code.co_name == "drain_state"
        if draining and not killed:
            os.kill(a.pid, signal.SIGKILL)
            a.wait(10)
            killed.append(a.pid)
            before = len(found["present_names"])
            wait_until(
                lambda: len(real(conn, gid, purpose, **bounds)["present_names"]) < before,
                15,
                "a's session lock to go with it",
            )
        return found

    monkeypatch.setattr(membership, "lock_holders", holders_then_kill)
    handled: list[int] = []
    # acks of one: each batch keeps its row done, so every message's reclaims stay readable
    consumer = pgq.Consumer(
        orders, "billing", lambda m: handled.append(m.id), **{**FAST, "batch_size": 1}
    )
    summary = consumer.run(until_empty=True, max_runtime=60)
    assert killed, "the drain never read the holders"
    assert summary.stop_reason == "empty", summary
    assert sorted(handled) == ids  # a's rows, once their leases ended
    found = rows(orders, "billing")
    assert all(found[mid].state == "done" and found[mid].reclaims == 1 for mid in ids)


def test_until_empty_sees_leases_of_a_killed_process_whose_name_a_restart_took(
    orders, pgq_env, tmp_path, procs
):
    """Service `svc` is `kill -9`ed holding leases and restarted under its name (a
    restarted service keeps its name): the new process holds none of the old one's
    leases. Before: a cron run counted them as the live `svc`'s and ended `empty`
    with them still leased by the dead process (found by attack)."""
    pin_frontier(orders, "orders")
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(2)])
    long_lease = consumer_env(pgq_env, tmp_path, TESTQ_TAG="a", **{**ENV, "PGQ_LEASE": "12"})
    first = spawn_pgq(
        long_lease, "consume", "billing", "--handler", "handlers:gated", "--name", "svc"
    )
    procs.append(first)
    wait_until(lambda: len(read_ids(tmp_path, "started")) == 2, 15, "svc to start both")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)

    def svc_live() -> bool:
        return [m["live"] for m in pgq.status(orders, "billing")["members"]] == [True]

    wait_until(lambda: not svc_live(), 15, "the killed svc to stop counting")
    again = member(pgq_env, tmp_path, "b", "--handler", "handlers:gated", "--name", "svc")
    procs.append(again)
    wait_until(svc_live, 15, "the restarted svc to take its name over")
    with orders.connect() as conn:
        started = conn.execute(
            select(t.member.c.started_at).where(t.member.c.name == "svc")
        ).scalar_one()

    cron = member(pgq_env, tmp_path, "c", "--handler", "handlers:record", "--until-empty")
    procs.append(cron)
    code, _, stderr = finish(cron, 30)
    assert code == 0, stderr
    assert summary_of(stderr)["stop_reason"] == "empty"
    found = rows(orders, "billing")
    stranded = [  # a finished message has no row (the ack deletes it)
        mid
        for mid, r in found.items()
        if r.state == "leased" and r.updated_at < started  # the dead one's
    ]
    assert not stranded, found
