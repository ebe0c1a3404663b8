"""The handler chaos members run: it logs every attempt, so the history checker can
tell what ran where, how often, and what it returned.

`pgq consume GROUP --handler chaos.handlers:work` (with `tests/` on `PYTHONPATH`,
as `helpers.consumer_env` sets it), driven by environment variables:

- `TESTQ_DIR`: the directory of the logs (one file per process: `attempts-<tag>-<pid>`);
- `TESTQ_TAG`: the member's name in the log (give the member the same `--name`);
- `CHAOSQ_SLEEP`: seconds of work per message, drawn uniformly from `0..2×` this
  (default 0.01), so kills and pauses land in the middle of handlers;
- `CHAOSQ_FSYNC=1`: fsync after every line (only a machine crash needs it).

Each attempt writes two lines, `<time> <pid> <member> <group> <id> <attempt> start`
before the work and `... ok` after it. A line is one `os.write` on an `O_APPEND`
descriptor: it is in the kernel the moment the call returns, so `kill -9`
never loses a line that was written, and concurrent threads never interleave.

In-process consumers use `AttemptLog(directory, member)` as their handler.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

OK = "ok"
START = "start"
FAILED = "failed"


class AttemptLog:
    """A handler that logs `start` and `ok` for every attempt to its own file."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        member: str,
        sleep: float = 0.01,
        fsync: bool = False,
    ) -> None:
        self.member = member
        self.sleep = sleep
        self.fsync = fsync
        self.path = Path(directory) / f"attempts-{member}-{os.getpid()}"
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _open(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            return self._fd

    def note(self, msg: Any, event: str) -> None:
        """Append one line for `msg` (a `pgq.Message`)."""
        line = (
            f"{time.time():.6f} {os.getpid()} {self.member} {msg.group} {msg.id}"
            f" {msg.attempt} {event}\n"
        )
        fd = self._open()
        os.write(fd, line.encode())
        if self.fsync:
            os.fsync(fd)

    def __call__(self, msg: Any) -> None:
        self.note(msg, START)
        try:
            if self.sleep > 0:
                time.sleep(random.uniform(0, 2 * self.sleep))
        except BaseException:
            self.note(msg, FAILED)
            raise
        self.note(msg, OK)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_log: AttemptLog | None = None
_log_lock = threading.Lock()


def _env_log() -> AttemptLog:
    global _log
    with _log_lock:
        if _log is None:
            _log = AttemptLog(
                os.environ["TESTQ_DIR"],
                os.environ.get("TESTQ_TAG") or str(os.getpid()),
                sleep=float(os.environ.get("CHAOSQ_SLEEP", "0.01")),
                fsync=os.environ.get("CHAOSQ_FSYNC") == "1",
            )
        return _log


def work(msg: Any) -> None:
    """The `pgq consume` handler: log, work a little, log."""
    _env_log()(msg)
