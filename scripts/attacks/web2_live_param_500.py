"""`?live=1` on a page that has no live part: HTTP 500 and a traceback.

A page asked with `?live=1` answers its live part (`_<page>.html`); the login
page and a change's result page have none, so `/login?live=1` and a requeue or
purge posted to `...?live=1` raised TemplateNotFound: 500, `Exception on
/groups/g/requeue [POST]` with a traceback in the log, and for the changes
after they were committed (the audit row is written; a script that retries a
500 requeues again).

Expected: these answer as they do without `?live=1` (200, 403), no traceback.
Exits 1 while the defect exists.
"""

from __future__ import annotations

import logging
import sys

from _common import Schema
from _web import TOKEN, dashboard, request
from helpers import kill

import pgq


class Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.lines.append(record.getMessage())


def main() -> int:
    tracebacks = Tracebacks()
    logging.getLogger().addHandler(tracebacks)
    s = Schema("web2_live_param")
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        ids = pgq.publish_many(s.engine, "t", [{"n": 1}, {"n": 2}])
        kill(s.engine, ids, "message")
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        with dashboard(s, token=TOKEN) as server:
            answers = {
                "GET /login?live=1": request(server.url, "GET", "/login?live=1").status,
                "POST /groups/g/requeue?live=1": request(
                    server.url,
                    "POST",
                    "/groups/g/requeue?live=1",
                    form={"ids": str(ids[0]), "reason": "x"},
                    headers=bearer,
                ).status,
                "POST /groups/g/purge?live=1": request(
                    server.url,
                    "POST",
                    "/groups/g/purge?live=1",
                    form={"reason": "x"},
                    headers=bearer,
                ).status,
            }
    finally:
        s.close()
    problems = [f"{what}: HTTP {status}" for what, status in answers.items() if status != 200]
    problems += [f"a traceback: {line}" for line in tracebacks.lines]
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print("held: ?live=1 on a page without a live part answers the page")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
