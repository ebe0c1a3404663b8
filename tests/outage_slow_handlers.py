"""Handlers for the outage tests with real member processes: the dependency of
`outage_handlers`, with every call the outage failed written down too.

Driven like `outage_handlers` (`TESTQ_DIR`, `TESTQ_TAG`, the `down` flag file,
`TESTQ_SLEEP`). A call that fails because the dependency is down appends
`<id> <tag> <attempt>` to `<TESTQ_DIR>/fail-<tag>` before it raises, so a test
knows exactly which rows the outage charged without asking the database; a
success appends the same to `done-<tag>`.
"""

from __future__ import annotations

import os
import time

from outage_handlers import dependency_down

import pgq


def _note(kind: str, msg: pgq.Message) -> None:
    tag = os.environ.get("TESTQ_TAG") or str(os.getpid())
    path = os.path.join(os.environ["TESTQ_DIR"], f"{kind}-{tag}")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{msg.id} {tag} {msg.attempt}\n".encode())
    finally:
        os.close(fd)


def recorded(msg: pgq.Message) -> None:
    """Call the simulated dependency; `{"poison": true}` always fails as a message error."""
    if msg.payload.get("poison"):
        raise ValueError("poison message")
    if dependency_down():
        _note("fail", msg)
        raise ConnectionError("dependency down")
    time.sleep(float(os.environ.get("TESTQ_SLEEP", "0")))
    _note("done", msg)
