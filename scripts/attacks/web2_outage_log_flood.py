"""While the database is down, every open page writes a warning line a refresh.

Each live update of each open tab is a request; while the database cannot be
reached each one was answered 503 (right) and logged `web request failed ...
cannot reach the database` (one line per request): one tab at the default
2 s refresh writes 30 lines a minute, ten tabs through a 10-minute outage
3,000, burying the one line that matters. The sampler already logs once per
failure streak. Here: 40 page and API reads against a database that refuses
connections.

Expected: a failure streak is logged once (and its end once). Exits 1 while
the defect exists.
"""

from __future__ import annotations

import logging
import socket
import sys

from _web import request

import pgq
from pgq.web import WebOptions, dashboard_server


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    records = Records()
    logger = logging.getLogger("pgq")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    gone = pgq.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", schema="nowhere")
    server = dashboard_server(gone, port=0, options=WebOptions(sample_every=3600))
    server.start()
    try:
        statuses = {
            request(server.url, "GET", p).status for p in ["/groups/g?live=1", "/api/groups"] * 20
        }
    finally:
        server.close()
        gone.dispose()
    failed = [line for line in records.lines if "failed" in line]
    problems = []
    if statuses != {503}:
        problems.append(f"answers {statuses} (want 503)")
    if len(failed) > 2:
        problems.append(f"{len(failed)} warning lines for 40 requests in one outage: {failed[0]!r}")
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print(f"held: one outage, {len(failed)} line(s) logged")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
