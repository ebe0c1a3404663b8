"""Every dashboard page in Chromium, with the browser console read after each.

A CSP violation, a script error or a failed fetch in the console is a defect
(the page's own status, on the 404 and 400 pages asked for here, is not).
Before the fix the first page logged `favicon.ico - Failed to load resource:
404`: the pages named no icon, so the browser asked for /favicon.ico, which
the dashboard did not serve. Exits 1 while any page logs such a line.
"""

from __future__ import annotations

import sys
import time

from _browser import chromium, console
from _common import Schema
from _web import TOKEN, dashboard

import pgq


def main() -> int:
    s = Schema("web2_console")
    problems: list[str] = []
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        [mid] = pgq.publish_many(s.engine, "t", [{"n": 1}])
        pages = [
            "",
            "?all=1",
            "groups/g",
            "groups/g?window=1m",
            f"groups/g/messages/{mid}",
            "login",
            "groups/nope",
            "groups/g?class=bogus",
            "no/such/page",
        ]
        with dashboard(s, token=TOKEN, refresh=0.3) as server, chromium() as driver:
            for page in pages:
                url = server.url + page
                driver.get(url)
                time.sleep(1.0)  # a few live updates
                for line in console(driver):
                    if not line.startswith(url + " "):  # not the page's own 404/400
                        problems.append(f"/{page}: {line}")
    finally:
        s.close()
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print("held: no page logs a console error, CSP violation or failed fetch")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
