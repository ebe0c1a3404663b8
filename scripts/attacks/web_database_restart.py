"""The dashboard while its database stops and comes back (an embedded server of its own).

What it checks: with requests running the whole time, stopping the server
turns every answer into a 503 (JSON on `/healthz` and `/api/...`, the error
page elsewhere) within a bounded time, never a 500, a hang or a traceback; when
the server is back the same dashboard answers 200 again without a restart.

Run: .venv/bin/python scripts/attacks/web_database_restart.py (~30 s; starts and
stops its own embedded PostgreSQL under a temporary $PGQ_HOME, never the shared
server). Exit 1 on a defect, 0 when it holds.
"""

import collections
import logging
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _common import verdict
from _web import request
from helpers import server_home

import pgq
from pgq import embedded
from pgq.web import WebOptions, dashboard_server


class Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(f"{record.name}: {record.getMessage()[:80]}")


tracebacks = Tracebacks()
logging.getLogger().addHandler(tracebacks)
logging.getLogger().setLevel(logging.INFO)

PATHS = ("/healthz", "/api/groups", "/", "/groups/g", "/groups/g?live=1")
problems: list[str] = []
with server_home("pgq-web-restart-") as home:
    dsn = embedded.ensure_running(home)
    engine = pgq.connect(dsn, schema="webrestart")
    pgq.migrate(engine)
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    pgq.publish_many(engine, "t", [{"i": i} for i in range(100)])
    server = dashboard_server(
        engine, host="127.0.0.1", port=0, options=WebOptions(sample_every=0.5)
    )
    server.start()
    phase = "up"
    seen: collections.Counter[tuple[str, str, object]] = collections.Counter()
    slowest: dict[str, float] = collections.defaultdict(float)
    stop = threading.Event()
    lock = threading.Lock()

    def hammer(k: int) -> None:
        i = k
        while not stop.is_set():
            path = PATHS[i % len(PATHS)]
            i += 1
            t0 = time.monotonic()
            try:
                status: object = request(server.url, "GET", path, timeout=60).status
            except Exception as exc:
                status = type(exc).__name__
            took = time.monotonic() - t0
            with lock:
                seen[(phase, path, status)] += 1
                slowest[phase] = max(slowest[phase], took)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(10)]
    for th in threads:
        th.start()
    time.sleep(2)
    phase = "stopping"
    embedded.stop(home)
    phase = "down"
    time.sleep(4)
    phase = "starting"
    embedded.ensure_running(home)
    phase = "back"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if request(server.url, "GET", "/healthz").status == 200:
            break
        time.sleep(0.1)
    else:
        problems.append("/healthz not 200 within 20 s of the database coming back")
    time.sleep(2)
    stop.set()
    for th in threads:
        th.join(90)
    server.close()
    engine.dispose()

for (ph, path, status), n in sorted(seen.items(), key=str):
    print(f"{ph:9} {path:18} {status}: {n}")
print("slowest answer per phase:", {k: round(v, 2) for k, v in slowest.items()})
for (ph, path, status), n in seen.items():
    if status not in (200, 503):
        problems.append(f"{ph}: GET {path} -> {status} ({n} times)")
    if ph == "down" and status != 503:
        problems.append(f"down: GET {path} -> {status} ({n} times), not 503")
    if ph in ("up",) and status != 200:
        problems.append(f"up: GET {path} -> {status} ({n} times)")
if slowest["down"] > 10:
    problems.append(f"an answer while the database was down took {slowest['down']:.1f} s")
if tracebacks.seen:
    problems.append(f"tracebacks logged: {sorted(set(tracebacks.seen))[:5]}")
verdict(problems, "a database that stops and comes back: 503s, then 200s, no 500, no hang")
