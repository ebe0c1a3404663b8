"""Under concurrent requests `pgq web` floods stderr with bare `Task queue depth is N` lines.

What it shows: waitress logs a WARNING on its `waitress.queue` logger for
every request that waits for one of its 8 threads. `pgq web` configures only
the `pgq` logger, so these reach Python's last-resort handler: bare lines on
stderr, outside pgq's log format (`--log-format json` promises JSON lines;
DESIGN §7: one event per line with key=value fields). 50 browsers' worth of
concurrent requests print hundreds of them. Flask's own `Exception on ...`
report of a 500 takes the same road.

Expected: every stderr line after the start-up line is one of pgq's log
lines (JSON with `--log-format json`), and a queue that drains by itself is not
a warning per request. Run: .venv/bin/python scripts/attacks/web_waitress_log_lines.py
(~10 s). Exit 1 while the defect exists, 0 once fixed. Severity: log noise /
broken JSON log stream.
"""

import json
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _common import PGQ, Schema, verdict
from _web import request

import pgq

problems: list[str] = []
with Schema("weblog") as s, tempfile.TemporaryDirectory() as tmp:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    log = Path(tmp) / "web.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [PGQ, "--log-format", "json", "web", "--port", "0"],
            env=s.env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline:
            found = re.search(r"^pgq web: (http://\S+/) ", log.read_text(), re.MULTILINE)
            url = found.group(1) if found else None
            time.sleep(0.1)
        assert url, log.read_text()

        def browse() -> None:
            for _ in range(4):
                request(url, "GET", "/groups/g")

        threads = [threading.Thread(target=browse) for _ in range(50)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    lines = log.read_text().splitlines()
    foreign = []
    for line in lines[1:]:  # the first is the `pgq web: URL` line for people
        try:
            json.loads(line)
        except ValueError:
            foreign.append(line)
    if foreign:
        problems.append(
            f"{len(foreign)} of {len(lines)} stderr lines are not JSON log lines,"
            f" e.g. {sorted(set(foreign))[:3]}"
        )
verdict(problems, "under load every stderr line of `pgq --log-format json web` is JSON")
