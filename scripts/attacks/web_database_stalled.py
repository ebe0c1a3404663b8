"""A database that stops answering (a stalled network, a hung host) hangs the dashboard.

What it shows: the dashboard's statements have no timeout, so while the
network to PostgreSQL is stalled (the chaos proxy of tests/chaos stops
forwarding; the TCP connection stays open, as with a hung host or a
blackholed route) every request that reads the database waits forever:
`/healthz` never answers 503, and once waitress's 8 threads are all waiting,
nothing answers at all, not even `/static/pgq.css` or a page that needs no
database (`/login`). A monitoring probe on `/healthz` sees a hang instead of
"database unavailable"; the operator sees a page that never loads.

Expected: `/healthz` answers 503 within a few seconds (a statement timeout
and a connect timeout on the dashboard's reads), and the pages say
"Database unavailable". Run:
.venv/bin/python scripts/attacks/web_database_stalled.py (~30 s). Exit 1 while
the defect exists, 0 once fixed. Severity: stall (monitoring blind).
"""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _common import DSN, Schema, verdict
from _web import request
from chaos.proxy import Proxy

import pgq
from pgq.web import dashboard_server

LIMIT = 10.0
problems: list[str] = []
with Schema("webstall") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    with Proxy.for_dsn(DSN) as proxy:
        engine = pgq.connect(proxy.dsn(DSN), schema=s.name)
        server = dashboard_server(engine, host="127.0.0.1", port=0)
        server.start()
        try:
            assert request(server.url, "GET", "/healthz").status == 200
            proxy.stall()
            answers: dict[str, object] = {}

            def ask(path: str) -> None:
                t0 = time.monotonic()
                try:
                    status: object = request(server.url, "GET", path, timeout=LIMIT).status
                except TimeoutError:
                    status = f"no answer within {LIMIT:g} s"
                except OSError as exc:
                    status = type(exc).__name__
                answers[path] = (status, round(time.monotonic() - t0, 1))

            # 8 page loads (waitress has 8 threads), then what needs no database
            pages = [threading.Thread(target=ask, args=(f"/groups/g?n={i}",)) for i in range(8)]
            for th in pages:
                th.start()
            time.sleep(1)
            for path in ("/healthz", "/static/pgq.css"):
                ask(path)
            for th in pages:
                th.join(LIMIT + 5)
            for path, (status, took) in sorted(answers.items()):
                print(f"GET {path}: {status} after {took} s")
                if path == "/static/pgq.css" and status != 200:
                    problems.append(f"GET {path} while the database is stalled: {status}")
                if path != "/static/pgq.css" and status != 503:
                    problems.append(f"GET {path} while the database is stalled: {status}")
        finally:
            proxy.resume()
            server.close()
            engine.dispose()
verdict(problems, "a stalled database: 503 within seconds, the static files still served")
