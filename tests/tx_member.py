"""A member process with a transactional handler, for the attacks with real processes
(`tests/integration/test_attack_tx_processes.py`) and the chaos run's transactional
groups (`tests/chaos`): `python tx_member.py`.

Driven by the environment: `TXQ_DSN`, `TXQ_SCHEMA`, `TXQ_GROUP`, `TXQ_NAME`,
`TXQ_EFFECTS` (the effect table's quoted name: columns `message_id`, `attempt`,
`member`), `TXQ_DIR` (where the handler notes what it did), `TXQ_SETTINGS` (the
consumer's keyword settings, JSON), `TXQ_UNTIL_EMPTY` (1: stop once the group is
empty), `TXQ_BATCH` (1: a `batch_handler`, called with up to `batch_size`
messages), `TXQ_SLEEP` (seconds of work per call, drawn from `0..2×` this; default
none) and `TXQ_NOTES` (0: note nothing, for long runs).

The handler takes `pg_advisory_xact_lock(TXQ_LOCK_KEY, id)` when `TXQ_LOCK_KEY` is
set, writes one effect row `(id, attempt, name)` per message on pgq's connection,
notes `started <id> <attempt>` in `TXQ_DIR/notes-<name>`; then, in batch mode, a
message whose id is in `TXQ_PARTIAL` (comma-separated) on its first attempt fails
alone: `partial <id>` is noted and `pgq.PartialFailure` raised for it. Then, when
the file `TXQ_DIR/hold-<id>` exists for one of its messages, it waits (bounded)
for `TXQ_DIR/go-<id>`, and notes `returned <id> <attempt>` for each. The CLI's
signal handlers are installed (first SIGTERM graceful, second exits at once); the
run's summary is the last line of stderr (`handled=... stop_reason=...`) and of
the notes (`summary {json}`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
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
    partial = {int(i) for i in env.get("TXQ_PARTIAL", "").split(",") if i}
    sleep = float(env.get("TXQ_SLEEP") or 0)
    noting = env.get("TXQ_NOTES") != "0"
    notes = out / f"notes-{name}"
    insert = text(f"INSERT INTO {table} (message_id, attempt, member) VALUES (:id, :attempt, :m)")

    def note(line: str) -> None:
        if not noting and not line.startswith("summary "):
            return
        fd = os.open(notes, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line}\n".encode())
        finally:
            os.close(fd)

    def handle(messages: list[pgq.Message], conn: Connection) -> None:
        for message in messages:
            if lock_key is not None:
                conn.execute(
                    text("SELECT pg_advisory_xact_lock(:k, :id)"),
                    {"k": int(lock_key), "id": message.id},
                )
            conn.execute(insert, {"id": message.id, "attempt": message.attempt, "m": name})
            note(f"started {message.id} {message.attempt}")
        failing = {
            m.id: ValueError("named") for m in messages if m.id in partial and m.attempt == 1
        }
        if failing:
            for mid in failing:
                note(f"partial {mid}")
            raise pgq.PartialFailure(failing)
        if sleep > 0:
            time.sleep(random.uniform(0, 2 * sleep))
        for message in messages:
            if (out / f"hold-{message.id}").exists():
                deadline = time.monotonic() + GATE_LIMIT
                while not (out / f"go-{message.id}").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
        for message in messages:
            note(f"returned {message.id} {message.attempt}")

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    engine = pgq.connect(env["TXQ_DSN"], schema=env["TXQ_SCHEMA"])
    settings = json.loads(env.get("TXQ_SETTINGS", "{}"))
    if env.get("TXQ_BATCH") == "1":
        handlers: dict[str, object] = {"batch_handler": handle}
    else:
        handlers = {"handler": lambda message, conn: handle([message], conn)}
    consumer = pgq.Consumer(
        engine, env["TXQ_GROUP"], name=name, transactional=True, **handlers, **settings
    )
    install_signal_handlers(consumer)
    summary = consumer.run(until_empty=env.get("TXQ_UNTIL_EMPTY") == "1")
    fields = dataclasses.asdict(summary)
    note(f"summary {json.dumps(fields)}")
    sys.stderr.write(" ".join(f"{k}={v}" for k, v in fields.items()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
