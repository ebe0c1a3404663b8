"""The overview grows with every minute the dashboard watches.

The overview's sparklines drew every sample the dashboard holds: up to 720
points a chart after an hour (a sample every 5 s while the overview is open),
on charts 160 px wide. With 500 groups the overview (and every live update
of it, every 2 s) was 7.8 MB of SVG after an hour, against 0.4 MB at start.
Here: 500 groups, an hour of samples put into the dashboard's history.

Expected: the page stays bounded (a chart needs a point or two per few pixels):
under 1.5 MB. Exits 1 while the defect exists.
"""

from __future__ import annotations

import sys
import time

from _common import Schema
from _web import dashboard, request

import pgq
from pgq import monitor


def main() -> int:
    s = Schema("web2_overview_size")
    try:
        pgq.create_topic(s.engine, "t")
        for i in range(500):
            pgq.subscribe(s.engine, f"g{i:03d}", "t")
        with dashboard(s, sample_every=3600) as server:
            history = server.dashboard.history
            groups = monitor.status_all(s.engine)["groups"]
            real, offset = history.clock, [0.0]
            start = real() - 3600
            history.clock = lambda: start + offset[0]
            for k in range(720):  # an hour, a sample every 5 s
                offset[0] = k * 5.0
                for g in groups:
                    g["counts"]["done"] += k % 7
                    g["lag"] = k % 13
                history.record(groups)
            history.clock = real
            started = time.monotonic()
            page = request(server.url, "GET", "/?all=1&live=1")
            took = time.monotonic() - started
    finally:
        s.close()
    size = len(page.body.encode())
    print(f"overview of 500 groups after an hour watched: {size / 1e6:.1f} MB in {took:.2f} s")
    if page.status != 200 or size > 1_500_000:
        print("DEFECT: the overview grows with the time watched")
        return 1
    print("held: the overview stays bounded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
