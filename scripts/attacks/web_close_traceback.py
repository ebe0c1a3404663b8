"""Closing the dashboard server while requests are in flight logs tracebacks.

What it shows: `WebServer.close()` (pgq/web/server.py) calls waitress's
`server.close()` from another thread while the waitress loop and its task
threads still run. A task thread that finishes a request afterwards pulls the
loop's trigger, whose pipe is already closed: waitress logs `Exception when
servicing <HTTPChannel ...>` with a traceback ending in `OSError: [Errno 9]
Bad file descriptor`. `pgq web` closes the same way on Ctrl-C, and
`pgq demo --web` and the tests on every stop; even a close right after the
last answer was read hits it now and then (a task thread pulls the trigger
after writing its answer).

Expected: a stop logs no traceback and raises nothing (stop the loop, then
let the task threads drain, then close). A first fix (close through the
loop's trigger, drain, then `close_all` through the trigger again) made
`close()` itself raise that OSError now and then: the second `pull_trigger`
wrote to a trigger the loop had closed already. Run: .venv/bin/python scripts/attacks/web_close_traceback.py
(~15 s). Exit 1 while the defect exists, 0 once fixed. Severity: cosmetic
(a traceback on stderr at every other Ctrl-C under load).
"""

import logging
import threading

from _common import Schema, verdict
from _web import dashboard, request

import pgq


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.tracebacks.append(f"{record.name}: {record.getMessage()[:60]}")


counter = Count()
logging.getLogger().addHandler(counter)
logging.getLogger().setLevel(logging.INFO)

ROUNDS = 20
rounds_with_traceback = 0
raised: list[str] = []
with Schema("webclose") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    for _ in range(ROUNDS):
        before = len(counter.tracebacks)
        threads: list[threading.Thread] = []
        try:
            with dashboard(s) as server:
                request(server.url, "GET", "/groups/g")

                def hit(url: str = server.url) -> None:
                    try:
                        request(url, "GET", "/groups/g", timeout=10)
                    except OSError:
                        pass  # closed under it: expected

                threads = [threading.Thread(target=hit) for _ in range(8)]
                for th in threads:
                    th.start()
        except Exception as exc:  # close() itself failed
            raised.append(repr(exc))
        for th in threads:
            th.join(15)
        rounds_with_traceback += len(counter.tracebacks) > before

problems = []
if rounds_with_traceback:
    problems.append(
        f"{rounds_with_traceback} of {ROUNDS} closes logged tracebacks:"
        f" {sorted(set(counter.tracebacks))[:3]}"
    )
if raised:
    problems.append(f"{len(raised)} of {ROUNDS} closes raised: {sorted(set(raised))[:3]}")
verdict(problems, "closing the server with requests in flight logs no traceback")
