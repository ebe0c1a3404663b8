"""Real `pgq consume` member processes to kill, pause and stop, with bounded waits.

    with Members(pgq_env, out, dsn=proxy.dsn(pg_dsn), settings=CHAOS_SETTINGS) as members:
        a = members.spawn("a", "work")                   # pgq consume work --name a ...
        members.wait_live(engine, "work", ["a"], ttl)    # joined and heartbeating
        a.kill9(); a.pause(); a.resume(); a.term()
        code = a.wait(15)

Each member runs `chaos.handlers:work` (its attempt log goes to `out`) under
`--name <name>`, so the log, `pgq status` and the delivery rows' `lease_owner`
all use the same name. `members.spawn_tx("t1", "txwork", table, batch=True)`
starts a member with a transactional handler instead (`tests/tx_member.py`): it
writes one row per message into the effect table `table` in the handler's
transaction, and logs no attempts (its effects are its history). Every signal
sent is recorded in `Members.events` with its wall-clock time: the history
checker uses them to explain duplicates.
Leaving the `with` block SIGCONTs and kills whatever still runs, and reaps it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import FAST, consumer_env, spawn_pgq, spawn_tx_member
from sqlalchemy import Engine

import pgq

from .handlers import AttemptLog

HANDLER = "chaos.handlers:work"

CHAOS_SETTINGS = {
    "PGQ_LEASE": "2.0",
    "PGQ_BREAKER_HEARTBEAT": "0.2",
    "PGQ_BREAKER_MEMBER_TTL": "1.0",
    "PGQ_POLL_INTERVAL": "0.1",
    "PGQ_RETRY_BACKOFF": "0.05",
    "PGQ_SHUTDOWN_GRACE": "5",
}
"""Short settings for chaos members, as the environment variables the CLI reads."""

TX_SETTINGS = {
    "lease": float(CHAOS_SETTINGS["PGQ_LEASE"]),
    "breaker_heartbeat": float(CHAOS_SETTINGS["PGQ_BREAKER_HEARTBEAT"]),
    "breaker_member_ttl": float(CHAOS_SETTINGS["PGQ_BREAKER_MEMBER_TTL"]),
    "poll_interval": float(CHAOS_SETTINGS["PGQ_POLL_INTERVAL"]),
    "retry_backoff": float(CHAOS_SETTINGS["PGQ_RETRY_BACKOFF"]),
    "shutdown_grace": float(CHAOS_SETTINGS["PGQ_SHUTDOWN_GRACE"]),
}
"""`CHAOS_SETTINGS` as the keyword settings of a transactional member (`tx_member.py`)."""


@dataclass
class ProcEvent:
    """A signal sent to a member (`kill9`, `stop`, `cont`, `term`) or its start/exit."""

    member: str
    kind: str
    at: float  # wall clock
    pid: int


class Member:
    """One `pgq consume` process."""

    def __init__(
        self,
        owner: Members,
        name: str,
        group: str,
        proc: subprocess.Popen[str],
        log: Path,
        tx: tuple[str, bool] | None = None,
    ) -> None:
        self.owner = owner
        self.name = name
        self.group = group
        self.proc = proc
        self.log = log
        self.tx = tx
        """A transactional member's effect table and whether it handles batches."""
        self.paused = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal(self, sig: signal.Signals, kind: str) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"member {self.name} already exited ({self.proc.returncode}):\n{self.stderr()}"
            )
        self.owner._record(self, kind)
        os.kill(self.proc.pid, sig)

    def kill9(self, timeout: float = 10.0) -> None:
        """`kill -9`, then reap it (bounded)."""
        self._signal(signal.SIGKILL, "kill9")
        self.proc.wait(timeout)
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process freezes, its connections stay open."""
        self._signal(signal.SIGSTOP, "stop")
        self.paused = True

    def resume(self) -> None:
        """SIGCONT."""
        self._signal(signal.SIGCONT, "cont")
        self.paused = False

    def term(self) -> None:
        """SIGTERM: a graceful stop (release unstarted rows, finish, leave)."""
        if self.paused:
            self.resume()
        self._signal(signal.SIGTERM, "term")

    def wait(self, timeout: float) -> int:
        """Wait for the exit code; kill it and fail past `timeout`."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.owner._record(self, "kill9")
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(
                f"member {self.name} did not exit within {timeout:g}s:\n{self.stderr()}"
            ) from None
        self.owner._record(self, "exit")
        return code

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait for the exit code."""
        self.term()
        return self.wait(timeout)

    def stderr(self, tail: int = 40) -> str:
        """The last lines of the member's log (its stderr)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-tail:])

    def summary(self) -> dict[str, str]:
        """The `handled=... stop_reason=...` line a finished `pgq consume` printed."""
        for line in reversed(self.log.read_text(errors="replace").splitlines()):
            if line.startswith("handled="):
                return dict(word.split("=", 1) for word in line.split())
        return {}


class Members:
    """Spawns and tracks member processes; a context manager that leaves none behind."""

    def __init__(
        self,
        pgq_env: Mapping[str, str],
        out: Path,
        *,
        dsn: str | None = None,
        settings: Mapping[str, object] | None = None,
        handler: str = HANDLER,
        **extra: object,
    ) -> None:
        """`pgq_env` is the fixture's environment; `dsn` replaces its `PGQ_DSN` (a
        proxy's); `settings` are `PGQ_*` variables; `extra` more variables
        (`CHAOSQ_SLEEP=0.02`)."""
        self.out = out
        self.handler = handler
        base = dict(pgq_env)
        if dsn is not None:
            base["PGQ_DSN"] = dsn
        self.env = consumer_env(base, out, **{**CHAOS_SETTINGS, **(settings or {}), **extra})
        self.members: list[Member] = []
        self.events: list[ProcEvent] = []

    def _log(self, name: str) -> Path:
        """`out/NAME.log`, or a numbered one for a later member of the same name."""
        log = self.out / f"{name}.log"
        n = 1
        while log.exists():
            n += 1
            log = self.out / f"{name}.{n}.log"
        return log

    def _record(self, member: Member, kind: str) -> None:
        self.events.append(ProcEvent(member.name, kind, time.time(), member.pid))

    def spawn(
        self,
        name: str,
        group: str,
        *args: str,
        workers: int = 4,
        until_empty: bool = False,
        verbose: bool = False,
        **extra: object,
    ) -> Member:
        """Start `pgq consume GROUP --name NAME --workers N [ARGS]`; stderr to `out/NAME.log`
        (a later member of the same name appends a numbered log)."""
        env = {**self.env, "TESTQ_TAG": name, **{k: str(v) for k, v in extra.items()}}
        log = self._log(name)
        cmd = [*(["-v"] if verbose else []), "consume", group, "--handler", self.handler]
        cmd += ["--name", name, "--workers", str(workers), *args]
        if until_empty:
            cmd.append("--until-empty")
        proc = spawn_pgq(env, *cmd, log=log)
        member = Member(self, name, group, proc, log)
        self.members.append(member)
        self._record(member, "spawn")
        return member

    def spawn_tx(
        self,
        name: str,
        group: str,
        effects: str,
        *,
        batch: bool,
        workers: int = 4,
        until_empty: bool = False,
    ) -> Member:
        """Start `tests/tx_member.py` as member `name` of `group`: a transactional
        handler (a batch handler with `batch`) writing one row per message into the
        effect table `effects` (quoted), through this chaos's DSN and settings; each
        handler call works `0..2×` `$CHAOSQ_TX_SLEEP` seconds (default 0.05)."""
        env = {
            **self.env,
            "TXQ_DSN": self.env["PGQ_DSN"],
            "TXQ_SCHEMA": self.env["PGQ_SCHEMA"],
            "TXQ_GROUP": group,
            "TXQ_NAME": name,
            "TXQ_EFFECTS": effects,
            "TXQ_DIR": str(self.out),
            "TXQ_SETTINGS": json.dumps({**TX_SETTINGS, "workers": workers}),
            "TXQ_UNTIL_EMPTY": "1" if until_empty else "0",
            "TXQ_BATCH": "1" if batch else "0",
            "TXQ_SLEEP": self.env.get("CHAOSQ_TX_SLEEP", "0.05"),
            "TXQ_NOTES": "0",
        }
        log = self._log(name)
        proc = spawn_tx_member(env, log)
        member = Member(self, name, group, proc, log, tx=(effects, batch))
        self.members.append(member)
        self._record(member, "spawn")
        return member

    def again(self, member: Member) -> Member:
        """Start another process like `member`: same name, group and kind (a `pgq
        consume` one verbose)."""
        if member.tx is not None:
            effects, batch = member.tx
            return self.spawn_tx(member.name, member.group, effects, batch=batch)
        return self.spawn(member.name, member.group, verbose=True)

    def live(self) -> list[Member]:
        return [m for m in self.members if m.alive()]

    def wait_live(
        self, engine: Any, group: str, names: Iterable[str], ttl: float, timeout: float = 20.0
    ) -> None:
        """Wait until every member of `names` counts as live in `group`."""
        wanted = set(names)
        deadline = time.monotonic() + timeout
        while True:
            found = pgq.status(engine, group, member_ttl=ttl)["members"]
            live = {m["name"] for m in found if m["live"]}
            if wanted <= live:
                return
            latest = {m.name: m for m in self.members}  # a restarted name: its newest process
            for member in latest.values():
                if member.name in wanted and not member.alive():
                    raise AssertionError(
                        f"member {member.name} exited ({member.proc.returncode}):\n"
                        f"{member.stderr()}"
                    )
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"members {sorted(wanted - live)} not live after {timeout:g}s: {found}"
                )
            time.sleep(0.05)

    def close(self) -> None:
        """SIGCONT and kill every member still running; reap all (bounded)."""
        for member in self.members:
            if member.proc.poll() is None:
                try:
                    os.kill(member.pid, signal.SIGCONT)
                    member.proc.kill()
                except ProcessLookupError:
                    pass
            try:
                member.proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                pass

    def __enter__(self) -> Members:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the history checker needs ----------------------------------------------

    def faults(self) -> list[ProcEvent]:
        """The kills and pauses (and resumes) sent, in order."""
        return [e for e in self.events if e.kind in ("kill9", "stop", "cont")]


IN_PROCESS = {**FAST, "lease": float(CHAOS_SETTINGS["PGQ_LEASE"]), "shutdown_grace": 5.0}
"""Settings of the in-process members (the chaos's lease)."""


class InProcessMembers:
    """In-process members (through the proxy), one per group started, each logging
    its attempts: they keep late-subscribed groups up and retention deleting while
    the chaos runs."""

    def __init__(self, engine: Engine, out: Path) -> None:
        self.engine = engine
        self.out = out
        self.running: list[tuple[pgq.Consumer, AttemptLog]] = []

    def start(self, group: str) -> None:
        log = AttemptLog(self.out, f"in-{group}", sleep=0.002)
        consumer = pgq.Consumer(
            self.engine, group, log, workers=2, name=f"in-{group}", **IN_PROCESS
        )
        consumer.start()
        self.running.append((consumer, log))

    def stop(self) -> list[str]:
        """Stop them all; what went wrong."""
        problems = []
        for consumer, _ in self.running:
            consumer.request_stop()
        for consumer, log in self.running:
            try:
                consumer.stop(timeout=10)
            except Exception as exc:  # reported with the summary
                problems.append(f"{log.member}: stop raised {type(exc).__name__}: {exc}")
            if not consumer.clean:
                problems.append(f"{log.member}: unclean stop")
            log.close()
        self.running = []
        return problems
