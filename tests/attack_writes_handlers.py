"""Handlers for the attacks on who writes outcomes (`tests/acceptance/test_attack_writes_*`):
each message waits for a gate file of its own, so a test finishes them one at a time.

Driven like `handlers.py`: `TESTQ_DIR` (where `started-<tag>` and `handled-<tag>`
get a line `<id> <tag> <attempt>` each) and `TESTQ_TAG`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pgq

GATE_LIMIT = 120.0
"""Seconds a handler waits at most for its gate (a test that forgot it still ends)."""


def _note(kind: str, msg: pgq.Message) -> None:
    tag = os.environ.get("TESTQ_TAG") or str(os.getpid())
    path = Path(os.environ["TESTQ_DIR"]) / f"{kind}-{tag}"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{msg.id} {tag} {msg.attempt}\n".encode())
    finally:
        os.close(fd)


def gated_each(msg: pgq.Message) -> None:
    """Record the start, wait for the file `go-<id>`, record the id."""
    _note("started", msg)
    gate = Path(os.environ["TESTQ_DIR"]) / f"go-{msg.id}"
    deadline = time.monotonic() + GATE_LIMIT
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    _note("handled", msg)
