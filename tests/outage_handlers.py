"""Handlers for the breaker tests: a dependency that is down while a flag file exists.

Driven like `handlers.py` (`TESTQ_DIR`, `TESTQ_TAG`): the dependency is down
while `<TESTQ_DIR>/down` exists, and for one member alone while
`<TESTQ_DIR>/down-<tag>` exists or `TESTQ_BAD=1` (a bad node). Payload
`{"poison": true}` always raises `ValueError` (a real dead letter);
`{"cursed": true}` always raises `ConnectionError` (poison misclassified as
systemic). Each successful call appends `<id> <tag> <attempt>` to `done-<tag>`.
While `<TESTQ_DIR>/hang-probes` exists a group probe writes `probing-<tag>` and
hangs until the flag is gone.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pgq
from pgq.consumer import PROBE_THREAD


def _tag() -> str:
    return os.environ.get("TESTQ_TAG") or str(os.getpid())


def _dir() -> Path:
    return Path(os.environ["TESTQ_DIR"])


def _note(kind: str, msg: pgq.Message) -> None:
    fd = os.open(_dir() / f"{kind}-{_tag()}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{msg.id} {_tag()} {msg.attempt}\n".encode())
    finally:
        os.close(fd)


def dependency_down() -> bool:
    """True while the simulated dependency is down for this member."""
    if os.environ.get("TESTQ_BAD") == "1":
        return True
    return (_dir() / "down").exists() or (_dir() / f"down-{_tag()}").exists()


def flaky(msg: pgq.Message) -> None:
    """Call the simulated dependency; poison and cursed payloads always fail."""
    if threading.current_thread().name == PROBE_THREAD and (_dir() / "hang-probes").exists():
        (_dir() / f"probing-{_tag()}").touch()
        while (_dir() / "hang-probes").exists():
            time.sleep(0.05)
    if msg.payload.get("poison"):
        raise ValueError("poison message")
    if msg.payload.get("cursed"):
        raise ConnectionError("misclassified poison")
    if dependency_down():
        raise ConnectionError("dependency down")
    time.sleep(float(os.environ.get("TESTQ_SLEEP", "0.002")))
    _note("done", msg)
