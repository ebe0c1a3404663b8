"""Anyone who reaches `pgq web --admin` makes it parse request bodies of any size.

What it shows: a change (`POST /groups/G/requeue`, `/purge`) reads the form
(its `csrf` field) before it can refuse the request, and `/login` reads it
for the token; neither Flask (`MAX_CONTENT_LENGTH` unset) nor waitress (whose
`max_request_body_size` is 1 GB by default) bounds the body. So a client with
no token at all, by posting one large url-encoded field, makes the server
spool it and decode it in memory: the server's peak RSS grows by about twice
the body (200 MB posted: several hundred MB more), and a few such requests at once
exhaust a small host's memory. The answer is the right 403, only late.

Expected: a body larger than any form the dashboard draws (a few kB; a long
id list perhaps 1 MB) is refused with 413 before it is read. Run:
.venv/bin/python scripts/attacks/web_huge_body.py (~20 s). Exit 1 while the
defect exists, 0 once fixed. Severity: denial of service (memory), local
network only (the dashboard listens on 127.0.0.1 by default).
"""

import http.client
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from _common import PGQ, Schema, verdict
from _web import TOKEN

import pgq

MB = 200


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


problems: list[str] = []
with Schema("webbody") as s, tempfile.TemporaryDirectory() as tmp:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    log = Path(tmp) / "web.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [PGQ, "web", "--admin", "--port", "0"],
            env=s.env(PGQ_WEB_TOKEN=TOKEN),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            found = re.search(r"^pgq web: http://127\.0\.0\.1:(\d+)/", log.read_text(), re.M)
            port = int(found.group(1)) if found else None
            time.sleep(0.1)
        assert port, log.read_text()
        before = peak_rss_mb(proc.pid)
        body = b"csrf=" + b"a" * (MB * 1024 * 1024)
        for path in ("/groups/g/requeue", "/login"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            try:
                conn.request(
                    "POST",
                    path,
                    body=body,
                    headers={"Content-Type": "application/x-www-form-urlencoded"},
                )
                status = conn.getresponse().status
            except OSError as exc:  # refused while sending: fine
                status = type(exc).__name__
            finally:
                conn.close()
            grew = peak_rss_mb(proc.pid) - before
            print(f"POST {path} with {MB} MB, no token: {status}; peak RSS +{grew:.0f} MB")
            if status not in (413, "ConnectionResetError", "BrokenPipeError") or grew > 50:
                problems.append(
                    f"POST {path} with a {MB} MB body and no token: HTTP {status},"
                    f" the server's peak RSS grew by {grew:.0f} MB"
                )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
verdict(problems, "a huge body is refused (413) before the server reads it")
