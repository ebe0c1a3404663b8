"""A flapping breaker's timeline claims a steady state it never had.

The group page reads the newest 50 transitions and 200 probes
(`breaker_info(history_limit=50, probe_limit=200)`). The timeline drew the
time before the oldest transition it read as one span of "the other state",
from the window's start: with 2,000 transitions ten seconds apart and
`?window=24h`, the page showed the breaker CLOSED, steadily, for 23.9 hours
(one `CLOSED epoch 1950` span), over hours in which it flapped 1,950 times.

Expected: the part of the window the page did not read is not drawn as OPEN
or CLOSED. Exits 1 while the defect exists.
"""

from __future__ import annotations

import re
import sys

from _common import Schema
from _web import dashboard, request
from sqlalchemy import text

import pgq


def main() -> int:
    s = Schema("web2_timeline")
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        with s.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO {s.name}.breaker_history (group_id, epoch, state, at, refunded)"
                    " SELECT g.id, n, CASE WHEN n % 2 = 1 THEN 'OPEN' ELSE 'CLOSED' END,"
                    " now() - make_interval(secs => (2001 - n) * 10), 0"
                    f" FROM {s.name}.consumer_group g, generate_series(1, 2000) n"
                )
            )
            conn.execute(text(f"UPDATE {s.name}.breaker SET epoch = 2000"))
        with dashboard(s) as server:
            page = request(server.url, "GET", "/groups/g?window=24h").body
    finally:
        s.close()
    spans = re.findall(
        r'<rect class="span (\w+)" x="([\d.]+)" y="4" width="([\d.]+)"[^>]*><title>([^<]*)</title>',
        page,
    )
    problems = [
        f"{title!r} drawn over {float(width) / 900:.0%} of the 24 h"
        for cls, _x, width, title in spans
        if cls in ("open", "closed") and float(width) > 900 * 0.5
    ]
    for p in problems:
        print("DEFECT: a span the page never read:", p)
    if not problems:
        print("held: the unread part of the timeline is not drawn as OPEN or CLOSED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
