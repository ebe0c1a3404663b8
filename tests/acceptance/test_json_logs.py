"""`pgq consume --log-format json`: every line on stderr one JSON object (issue 21).

A real member runs through an outage of its dependency (tests/outage_handlers.py:
down while a flag file exists): it trips, opens the group alone, probes, closes
and reconciles; then SIGTERM stops it. A run with a handler path that does not
import fails at once. Every line either wrote must parse as a JSON object, every
event of the member carry its group and its name (a hostile one, which must not
forge a field in the text format either), each breaker transition be logged once,
the run summary be an object of JSON values, and the progress line come.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import PGQ, consumer_env, finish, wait_until
from members import ConsumeProcesses, consume_processes
from sqlalchemy import Engine

import pgq
from pgq import monitor

pytestmark = pytest.mark.slow

NAME = 'm1 group=payments level=ERROR x="y'
"""A member name that would forge fields in an unquoted key=value line."""

SETTINGS = {
    "PGQ_LOG_FORMAT": "json",
    "PGQ_WORKERS": 2,
    "PGQ_LEASE": 5,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_MAX_ATTEMPTS": 2,
    "PGQ_RETRY_BACKOFF": 0.02,
    "PGQ_RETRY_BACKOFF_MAX": 0.05,
    "PGQ_BREAKER_WINDOW": 10,
    "PGQ_BREAKER_MIN_CALLS": 10,
    "PGQ_BREAKER_MIN_MEMBERS": 1,
    "PGQ_BREAKER_OPEN_FOR": 0.5,
    "PGQ_BREAKER_OPEN_FOR_MAX": 1,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": 1.5,
    "PGQ_BREAKER_PROBE_INTERVAL": 0.3,
    "PGQ_BREAKER_PROBE_INTERVAL_MAX": 0.6,
    "TESTQ_PROGRESS_EVERY": 0.5,
}


class Member(ConsumeProcesses):
    def __init__(self, engine: Engine, env: dict[str, str], out: Path) -> None:
        super().__init__(engine, env, out, "progress_handlers:flaky", SETTINGS)

    def events(self) -> list[dict[str, Any]]:
        """Every line of the member's stderr, each of which must be a JSON object."""
        events = []
        for line in self.log_text(NAME).splitlines():
            event = json.loads(line)
            assert isinstance(event, dict), line
            events.append(event)
        return events


@pytest.fixture
def member(engine: Engine, pgq_env: dict[str, str], tmp_path: Path) -> Iterator[Member]:
    with consume_processes(Member, engine, pgq_env, tmp_path) as group:
        yield group


def breaker(engine: Engine) -> dict[str, Any]:
    return dict(pgq.status(engine, "g")["breaker"])


def test_a_member_through_an_outage_and_sigterm_writes_only_json_lines(member, engine):
    pgq.publish_many(engine, "t", [{"n": i} for i in range(200)])
    (member.out / "down").touch()
    proc = member.spawn(NAME)
    wait_until(lambda: breaker(engine)["state"] == "OPEN", 30, "the group to open")
    (member.out / "down").unlink()
    wait_until(
        lambda: breaker(engine)["state"] == "CLOSED" and pgq.status(engine, "g")["lag"] == 0,
        60,
        "the group to close and drain",
    )
    wait_until(
        lambda: sum(e["message"].startswith("progress") for e in member.events()) >= 2,
        20,
        "two progress lines",
    )
    proc.send_signal(signal.SIGTERM)
    code, _, _ = finish(proc, 30)
    events = member.events()
    assert code == 0, events

    for event in events:  # every event is about the group and the member
        assert (event.get("group"), event.get("member")) == ("g", NAME), event
        assert {"time", "level", "logger", "message"} <= set(event), event

    # each transition this member saw is logged once, what it did to make it too
    history = monitor.breaker_info(engine, "g")["history"]
    transitions = Counter(
        (e["message"].split(" epoch=")[0], e["epoch"])
        for e in events
        if e["message"].startswith("group breaker")
    )
    word = {"OPEN": "group breaker open", "CLOSED": "group breaker closed"}
    assert transitions == Counter((word[h["state"]], h["epoch"]) for h in history), history
    assert {e.get("by") for e in events if e["message"].startswith("group breaker")} == {
        "quorum",
        "probe",
    }

    progress = [e for e in events if e["message"].startswith("progress")]
    assert all(isinstance(e["handled"], int) and e["handled"] >= 0 for e in progress), progress
    assert all(isinstance(e["rate"], int | float) for e in progress), progress
    assert all(e["lag"] is None or isinstance(e["lag"], int) for e in progress), progress
    assert {e["breaker"] for e in progress} <= {"CLOSED", "OPEN"}, progress
    assert sum(e["handled"] for e in progress) <= 200 * 2 + 10
    assert not [e for e in events if e["message"].startswith("analyzed delivery")]

    [left] = [e for e in events if e["message"].startswith("member left")]
    [summary] = [e for e in events if e["message"] == "run summary"]
    assert events[-1] is summary
    for key in ("handled", "done", "retried", "dead", "released", "reclaimed", "waiting_retry"):
        assert isinstance(summary[key], int) and summary[key] == left[key], (key, summary, left)
    assert summary["stop_reason"] == left["stop_reason"] == "signal"
    assert summary["done"] >= 200 - summary["dead"] - 1


def test_a_bad_handler_path_is_one_json_error_line(engine, pgq_env, tmp_path):
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    env = consumer_env(pgq_env, tmp_path)
    out = subprocess.run(
        [*PGQ, "--log-format", "json", "consume", "g", "--handler", "no_such_module:handle"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.splitlines()
    event = json.loads(line)
    assert event["level"] == "ERROR" and event["exit_code"] == 2 and event["group"] == "g"
    assert "no_such_module" in event["error"] and event["message"] == event["error"]
