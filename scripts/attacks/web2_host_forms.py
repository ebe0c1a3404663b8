"""`pgq web --host` with a loopback address other than the three names it knew.

- `--host 127.0.0.2` (any of 127.0.0.0/8 is this machine's loopback) warned
  `web listening beyond this machine ... anyone who reaches it can read every
  group`: a false alarm;
- `--host [::1]` (the bracketed form people copy from URLs) warned the same,
  and printed `http://[[::1]]:PORT/`, a URL no browser opens.

Expected: no warning for a loopback address, and the printed URL answers
`/healthz` with 200. Exits 1 while the defect exists.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request

from _common import PGQ, Schema


def run(s: Schema, host: str) -> list[str]:
    proc = subprocess.Popen(
        [PGQ, "web", "--host", host, "--port", "0"],
        env=s.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "pgq web: " in line or len(lines) > 5:
            break
    problems = []
    found = re.search(r"pgq web: (\S+) ", "".join(lines))
    try:
        if any("beyond this machine" in line for line in lines):
            problems.append(f"--host {host}: warns it listens beyond this machine")
        url = found.group(1) if found else ""
        try:
            with urllib.request.urlopen(url + "healthz", timeout=10) as answer:
                status = answer.status
        except (OSError, ValueError) as exc:
            status = repr(exc)
        if status != 200:
            problems.append(f"--host {host}: the printed URL {url!r} does not answer: {status}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    return problems


def main() -> int:
    s = Schema("web2_hosts")
    try:
        problems = run(s, "127.0.0.2") + run(s, "[::1]")
    finally:
        s.close()
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print("held: loopback addresses in any form listen quietly, and the URL printed works")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
