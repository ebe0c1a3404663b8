"""Handlers for `pgq consume` subprocesses in tests (`--handler handlers:record`).

They are driven by environment variables (not `PGQ_*`, which the CLI checks):

- `TESTQ_DIR`: directory where each process appends what it did, one file per
  kind and process: `started-<tag>`, `handled-<tag>` (lines `<id> <tag>`);
- `TESTQ_TAG`: names this process in those lines (default: its pid);
- `TESTQ_SLEEP`: seconds `slow` sleeps per message;
- `gated` waits until the file `<TESTQ_DIR>/<TESTQ_GATE>` exists (default `go`).

Every line is one `os.write` on an `O_APPEND` file, so concurrent worker
threads never interleave within a line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pgq

GATE_LIMIT = 120.0
"""Seconds a gated handler waits at most (a test that forgot its gate still ends)."""


def _tag() -> str:
    return os.environ.get("TESTQ_TAG") or str(os.getpid())


def _note(kind: str, msg: pgq.Message) -> None:
    path = Path(os.environ["TESTQ_DIR"]) / f"{kind}-{_tag()}"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{msg.id} {_tag()} {msg.attempt}\n".encode())
    finally:
        os.close(fd)


def record(msg: pgq.Message) -> None:
    """Handle at once: record the id."""
    _note("handled", msg)


def slow(msg: pgq.Message) -> None:
    """Record the start, sleep `TESTQ_SLEEP` seconds, record the id."""
    _note("started", msg)
    time.sleep(float(os.environ.get("TESTQ_SLEEP", "0.1")))
    _note("handled", msg)


def gated(msg: pgq.Message) -> None:
    """Record the start, wait for the gate file, record the id."""
    _note("started", msg)
    gate = Path(os.environ["TESTQ_DIR"]) / os.environ.get("TESTQ_GATE", "go")
    deadline = time.monotonic() + GATE_LIMIT
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    _note("handled", msg)


def snooze_once(msg: pgq.Message) -> None:
    """Snooze each message once for `TESTQ_SNOOZE` seconds (default 0.3), then record it."""
    marker = Path(os.environ["TESTQ_DIR"]) / f"snoozed-{msg.id}"
    if not marker.exists():
        marker.touch()
        raise pgq.RetryLater(float(os.environ.get("TESTQ_SNOOZE", "0.3")))
    _note("handled", msg)
