"""A member process with a transactional handler, for the attacks with real processes
(`tests/integration/test_attack_tx_processes.py`): `python tx_member.py`.

Driven by the environment: `TXQ_DSN`, `TXQ_SCHEMA`, `TXQ_GROUP`, `TXQ_NAME`,
`TXQ_EFFECTS` (the effect table's quoted name), `TXQ_DIR` (where the handler notes
what it did), `TXQ_SETTINGS` (the consumer's keyword settings, JSON) and
`TXQ_UNTIL_EMPTY` (1: stop once the group is empty).

The handler takes `pg_advisory_xact_lock(TXQ_LOCK_KEY, id)` when `TXQ_LOCK_KEY` is
set, writes the effect row `(id, attempt)` on pgq's connection, notes
`started <id> <attempt>` in `TXQ_DIR/notes-<name>`, then, when the file
`TXQ_DIR/hold-<id>` exists, waits (bounded) for `TXQ_DIR/go-<id>`, and notes
`returned <id> <attempt>`. The CLI's signal handlers are installed (first SIGTERM
graceful, second exits at once).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from sqlalchemy import Connection, text

import pgq
from pgq.cli.consume import install_signal_handlers

GATE_LIMIT = 120.0
"""Seconds a held handler waits at most for its go file."""


def main() -> int:
    env = os.environ
    out = Path(env["TXQ_DIR"])
    name = env["TXQ_NAME"]
    table = env["TXQ_EFFECTS"]
    lock_key = env.get("TXQ_LOCK_KEY")
    notes = out / f"notes-{name}"

    def note(line: str) -> None:
        fd = os.open(notes, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line}\n".encode())
        finally:
            os.close(fd)

    def handler(message: pgq.Message, conn: Connection) -> None:
        if lock_key is not None:
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:k, :id)"),
                {"k": int(lock_key), "id": message.id},
            )
        conn.execute(
            text(f"INSERT INTO {table} VALUES (:id, :attempt)"),
            {"id": message.id, "attempt": message.attempt},
        )
        note(f"started {message.id} {message.attempt}")
        if (out / f"hold-{message.id}").exists():
            deadline = time.monotonic() + GATE_LIMIT
            while not (out / f"go-{message.id}").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        note(f"returned {message.id} {message.attempt}")

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    engine = pgq.connect(env["TXQ_DSN"], schema=env["TXQ_SCHEMA"])
    settings = json.loads(env.get("TXQ_SETTINGS", "{}"))
    consumer = pgq.Consumer(
        engine, env["TXQ_GROUP"], handler, name=name, transactional=True, **settings
    )
    install_signal_handlers(consumer)
    summary = consumer.run(until_empty=env.get("TXQ_UNTIL_EMPTY") == "1")
    note(f"summary {json.dumps(dataclasses.asdict(summary))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
