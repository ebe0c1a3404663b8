"""Real `pgq consume` member processes of group `g` on topic `t`, for the outage tests.

`ConsumeProcesses` starts members by name with a handler from the tests folder and
short settings, keeps each one's log in the test's directory (where the handlers
also write their flag and record files), and stops them; `consume_processes`
creates the topic and group, yields the processes, and at the end kills what is
left (resuming a paused one first) and prints the tail of every log, which pytest
shows when the test failed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from helpers import consumer_env, finish, reap, spawn_pgq
from sqlalchemy import Engine

import pgq

P = TypeVar("P", bound="ConsumeProcesses")


class ConsumeProcesses:
    """`pgq consume g --handler HANDLER --name NAME` processes, by name."""

    def __init__(
        self,
        engine: Engine,
        env: Mapping[str, str],
        out: Path,
        handler: str,
        settings: Mapping[str, object],
    ) -> None:
        self.engine, self.env, self.out = engine, env, out
        self.handler, self.settings = handler, dict(settings)
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def spawn(self, name: str, *args: str, **settings: object) -> subprocess.Popen[str]:
        """Start member `name` (more `pgq consume` options in `args`, settings as
        `PGQ_...=value` over the defaults of this group of processes)."""
        env = consumer_env(
            self.env,
            self.out,
            TESTQ_TAG=name,
            PGAPPNAME=name,  # libpq's default application_name: `process_of` reads it back
            **{**self.settings, **settings},
        )
        args = ("consume", "g", "--handler", self.handler, "--name", name, *args)
        proc = spawn_pgq(env, *args, log=self.log_path(name))
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.out / f"{name}.log"

    def log_text(self, name: str) -> str:
        return self.log_path(name).read_text()

    def breaker(self) -> dict[str, Any]:
        return dict(pgq.status(self.engine, "g")["breaker"])

    def stop_all(self, *, killed_ok: bool = True, clean_logs: bool = False) -> None:
        """SIGTERM every member still running; each must exit 0 (or have been killed
        with `kill -9`, when `killed_ok`), and with `clean_logs` log no traceback."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        allowed = (0, -signal.SIGKILL) if killed_ok else (0,)
        for name, proc in self.procs.items():
            code, _, _ = finish(proc, 30)
            log = self.log_text(name)
            assert code in allowed, (name, code, log)
            assert not clean_logs or "Traceback" not in log, (name, log)


@contextlib.contextmanager
def consume_processes(
    factory: type[P], engine: Engine, env: Mapping[str, str], out: Path, tail: int = 40
) -> Iterator[P]:
    """Topic `t`, group `g` and a `factory(engine, env, out)` of member processes;
    afterwards nothing of them is left running."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    group = factory(engine, env, out)  # type: ignore[call-arg]
    try:
        yield group
    finally:
        for proc in group.procs.values():
            reap(proc)  # a paused member dies too; an exited one's pipes are closed
        for log in sorted(out.glob("*.log")):
            print(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-tail:]))
