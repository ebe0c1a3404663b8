"""Closing the dashboard while its sampler reads logs a false alarm.

`close()` ends the reads in flight by shutting their sockets down
(`ReadDeadline.close`); the `pgq-web-sampler` thread's read, cut that way, was
logged as `web sample failed error='cannot reach the database: ... server
closed the connection unexpectedly'`: a stopped `pgq web` (Ctrl-C, SIGTERM)
wrote a warning about the database that nothing was wrong with. Seen with 500
groups, where a sample takes long enough to be caught; here the sampler reads
back to back, so most closes catch one.

Expected: closing logs nothing about the database. Exits 1 while the defect exists.
"""

from __future__ import annotations

import logging
import sys
import time

from _common import Schema
from _web import dashboard

import pgq


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> int:
    records = Records()
    logging.getLogger("pgq").addHandler(records)
    s = Schema("web2_close_sample")
    try:
        pgq.create_topic(s.engine, "t")
        for i in range(50):
            pgq.subscribe(s.engine, f"g{i}", "t")
        for _ in range(20):
            with dashboard(s, sample_every=0.0) as server:
                deadline = time.monotonic() + 10
                while not server.dashboard.history.samples("g0"):  # the sampler reads
                    assert time.monotonic() < deadline, "the sampler never sampled"
                    time.sleep(0.01)
    finally:
        s.close()
    false = [line for line in records.lines if "sample failed" in line]
    if false:
        print(f"DEFECT: {len(false)} of 20 closes logged: {false[0]}")
        return 1
    print("held: closing the dashboard logs nothing about the database")
    return 0


if __name__ == "__main__":
    sys.exit(main())
