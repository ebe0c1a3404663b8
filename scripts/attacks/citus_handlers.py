"""Handlers for the `citus_*` attack scripts' `pgq consume --handler citus_handlers:NAME`.

`record`: appends `<id> <attempt> <pid> <payload-json>` to `<ATK_DIR>/ok-<ATK_TAG>` after
sleeping `ATK_SLEEP` seconds (default 0); a line is written only once the handler is done.
`outage`: raises ConnectionError while `<ATK_DIR>/down` exists, else records.
"""

import json
import os
import time

import pgq


def _append(msg: pgq.Message) -> None:
    path = os.path.join(os.environ["ATK_DIR"], f"ok-{os.environ.get('ATK_TAG', 'x')}")
    line = f"{msg.id} {msg.attempt} {os.getpid()} {json.dumps(msg.payload)}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def record(msg: pgq.Message) -> None:
    time.sleep(float(os.environ.get("ATK_SLEEP", "0")))
    _append(msg)


def outage(msg: pgq.Message) -> None:
    if os.path.exists(os.path.join(os.environ["ATK_DIR"], "down")):
        raise ConnectionError("dependency down")
    record(msg)


def poison(msg: pgq.Message) -> None:
    if msg.payload.get("poison"):
        raise ValueError("poison message")
    record(msg)
