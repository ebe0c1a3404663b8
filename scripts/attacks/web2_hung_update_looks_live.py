"""A dashboard that stops answering leaves its pages saying "live".

`static/live.js` said "connection lost" when an update failed, but an update
that never ends (the dashboard's host frozen, a stalled SSH tunnel, a proxy
that accepts and never answers) is no failure: the fetch waited for good, no
further update was scheduled, and the page kept saying `live · <time>` over
data that no longer moved. Here: `pgq web` is SIGSTOPped under an open page
in Chromium (refresh 2 s); 15 s later the page still says "live".

Expected: an update that takes far longer than the refresh is given up and
the page says the connection is lost. Exits 1 while the defect exists.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from _browser import chromium
from _common import PGQ, Schema

import pgq


def main() -> int:
    s = Schema("web2_hung_update")
    proc = None
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        proc = subprocess.Popen(
            [PGQ, "web", "--port", "0"], env=s.env(), stderr=subprocess.PIPE, text=True
        )
        assert proc.stderr is not None
        found = re.search(r"(http://\S+/) ", proc.stderr.readline())
        assert found, "pgq web printed no URL"
        with chromium() as driver:
            driver.get(found.group(1) + "groups/g")
            deadline = time.monotonic() + 15
            while not driver.find_element("id", "live-status").text.startswith("live ·"):
                assert time.monotonic() < deadline, "the page never updated"
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                time.sleep(15)
                shown = driver.find_element("id", "live-status").text
            finally:
                os.kill(proc.pid, signal.SIGCONT)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        s.close()
    if shown.startswith("live"):
        print(f"DEFECT: 15 s after the dashboard stopped answering the page says {shown!r}")
        return 1
    print(f"held: the page says {shown!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
