"""Shared plumbing for the breaker-probe attacks (probe_kill9_points, probe_sigstop_resume,
probe_prober_conns_faults, probe_cron_prober_killed, paused_prober): a group `g` on
topic `t` whose `pgq consume` members call a dependency that is down while
`<dir>/down` exists, the breaker settings they run with, waiting for states, and the
checks on the breaker's history once the outage is over.

Handler side (imported by the `pgq consume` members through the scripts' handlers):
`PROBE_LOG`, `append_line`, `outage_handler`. Driver side: `breaker_settings`, `wait`,
`Outage`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _common import PGQ, Schema

import pgq
from pgq import monitor

PROBE_LOG = "probes.log"
"""Every probe's handler run appends `start <member> <id> <time>` and `end ...` lines here."""


def append_line(path: Path, line: str) -> None:
    """Append one line with a single write (O_APPEND: lines of processes never interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def outage_handler(
    msg,
    probe_body: Callable[[Path, str], Callable[[], object] | None],
    *,
    mark_outcome: bool = False,
) -> None:
    """The members' handler: the dependency is down while `<TESTQ_DIR>/down` exists.

    A probe (the handler on the prober's probe thread) logs its start in PROBE_LOG, runs
    `probe_body(dir, member)`, logs its end (with ` down`/` ok` when `mark_outcome`) and
    then calls what `probe_body` returned, if anything; any other call takes 2 ms.
    """
    from pgq.consumer import PROBE_THREAD

    d, tag = Path(os.environ["TESTQ_DIR"]), os.environ["TESTQ_TAG"]
    probe = threading.current_thread().name == PROBE_THREAD
    after = None
    if probe:
        append_line(d / PROBE_LOG, f"start {tag} {msg.id} {time.time():.6f}")
        after = probe_body(d, tag)
    down = (d / "down").exists()
    if probe:
        line = f"end {tag} {msg.id} {time.time():.6f}"
        if mark_outcome:
            line += f" {'down' if down else 'ok'}"
        append_line(d / PROBE_LOG, line)
        if after is not None:
            after()
    else:
        time.sleep(0.002)
    if down:
        raise ConnectionError("dependency down")


def breaker_settings(ttl: float, **overrides: str) -> dict[str, str]:
    """The members' environment: 2 workers, fast retries, a breaker that opens after 4
    failures with one member, member_ttl `ttl`, probes every 0.3-0.6 s, the prober never
    handing over; lease and handler_timeout 30 s unless `overrides` say otherwise."""
    settings = dict(
        PGQ_WORKERS="2",
        PGQ_LEASE="30",
        PGQ_HANDLER_TIMEOUT="30",
        PGQ_POLL_INTERVAL="0.1",
        PGQ_MAX_ATTEMPTS="50",
        PGQ_RETRY_BACKOFF="0.02",
        PGQ_RETRY_BACKOFF_MAX="0.05",
        PGQ_BREAKER_WINDOW="4",
        PGQ_BREAKER_MIN_CALLS="4",
        PGQ_BREAKER_MIN_MEMBERS="1",
        PGQ_BREAKER_HEARTBEAT="0.2",
        PGQ_BREAKER_MEMBER_TTL=str(ttl),
        PGQ_BREAKER_PROBE_INTERVAL="0.3",
        PGQ_BREAKER_PROBE_INTERVAL_MAX="0.6",
        PGQ_BREAKER_PROBER_TURNS="1000",
    )
    settings.update(overrides)
    return settings


def wait(predicate, seconds: float, step: float = 0.05):
    """Poll `predicate` every `step` s for `seconds`; its first truthy value, else its last."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(step)
    return predicate()


class Outage:
    """Group `g` on topic `t` in `s` with `messages` rows published, a fresh directory
    `out` for the handler's flag files, PROBE_LOG and the members' logs
    (`out/<member>.log`), and the `pgq consume` members started with `start` (with
    `settings` in their environment), all stopped on exit (SIGCONT first when `resume`).

    `tag` prefixes the problems the checks word (e.g. "[mid] ").
    """

    def __init__(
        self,
        s: Schema,
        handler: str,
        settings: dict[str, str],
        *,
        messages: int = 60,
        tag: str = "",
        resume: bool = False,
    ) -> None:
        self.s = s
        self.handler = handler
        self.settings = settings
        self.tag = tag
        self.resume = resume
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.out = Path(tempfile.mkdtemp())
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        self.ids = pgq.publish_many(s.engine, "t", [{"i": i} for i in range(messages)])

    def popen(
        self, name: str, *args: str, stderr=None, dsn: str | None = None, **env: object
    ) -> subprocess.Popen[bytes]:
        """`pgq consume g --handler <handler> --name <name> *args`; stderr to
        `out/<name>.log` unless given; `dsn` instead of the schema's."""
        environ = self.s.env(TESTQ_DIR=self.out, TESTQ_TAG=name, **{**self.settings, **env})
        if dsn is not None:
            environ["PGQ_DSN"] = dsn
        return subprocess.Popen(
            [PGQ, "consume", "g", "--handler", self.handler, "--name", name, *args],
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=(self.out / f"{name}.log").open("w") if stderr is None else stderr,
        )

    def start(self, *names: str, dsn: str | None = None, **env: object) -> None:
        """Start members `names` (stopped on exit)."""
        for name in names:
            self.procs[name] = self.popen(name, dsn=dsn, **env)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                if self.resume:
                    proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Outage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def breaker(self) -> dict:
        return pgq.status(self.s.engine, "g")["breaker"]

    def open_outage(self, problems: list[str]) -> int | None:
        """With the dependency down, start members m1, m2, m3 and wait for the group to
        open and two probes to fail: the outage's epoch, or None (a setup problem filed)."""
        (self.out / "down").touch()
        self.start("m1", "m2", "m3")
        if not wait(lambda: self.breaker()["state"] == "OPEN", 40):
            problems.append(f"{self.tag}setup: the group did not open: {self.breaker()}")
            return None
        epoch = self.breaker()["epoch"]
        if not wait(lambda: self.probes_ended(2), 20):
            problems.append(f"{self.tag}setup: no failed probes")
            return None
        return epoch

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text()

    def probes_ended(self, n: int) -> bool:
        """At least `n` probes ended (PROBE_LOG)."""
        log = self.out / PROBE_LOG
        return log.exists() and log.read_text().count("end ") >= n

    def all_done(self) -> bool:
        return pgq.status(self.s.engine, "g")["counts"]["done"] == len(self.ids)

    def history(self) -> list[dict]:
        return monitor.breaker_info(self.s.engine, "g")["history"]

    def check_one_close(self, epoch: int, problems: list[str]) -> tuple[list[dict], list[dict]]:
        """The breaker history and its CLOSED rows after `epoch`: there must be one."""
        history = self.history()
        closes = [h for h in history if h["state"] == "CLOSED" and h["epoch"] > epoch]
        if len(closes) != 1:
            problems.append(f"{self.tag}the outage was closed {len(closes)} times: {closes}")
        return history, closes

    @staticmethod
    def refunded_in(history: list[dict]) -> int:
        """The refunds the history's CLOSED rows count."""
        return sum(h["refunded"] for h in history if h["state"] == "CLOSED")

    def check_refunds(self, history: list[dict], problems: list[str]) -> None:
        """The group's refunded total must equal the history's."""
        total = pgq.status(self.s.engine, "g")["totals"]["refunded"]
        in_history = self.refunded_in(history)
        if total != in_history:
            problems.append(
                f"{self.tag}refunded total {total} != refunds in the history {in_history}"
            )

    def check_tracebacks(self, problems: list[str], names=None) -> None:
        """No member (or each of `names`) logged a traceback."""
        for name in self.procs if names is None else names:
            if "Traceback" in self.log(name):
                problems.append(f"{self.tag}{name} logged a traceback")
