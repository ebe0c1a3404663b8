"""`pgq demo --web` with its port taken starts the story before it finds out.

Before the fix the demo created and migrated its scratch schema, printed its
first narration line on stdout (`schema pgq_demo_...: topic orders, ...`),
and only then failed to listen: exit 2 with a half-told story, against the
rule that a usage error is one line on stderr with nothing half-written.

Expected: exit 2, one line on stderr naming the address, nothing on stdout.
Exits 1 while the defect exists.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from _common import DSN, PGQ


def main() -> int:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [PGQ, "demo", "--web", "--port", str(port), "--dsn", DSN],
            capture_output=True,
            text=True,
            timeout=120,
        )
    problems = []
    if proc.returncode != 2:
        problems.append(f"exit {proc.returncode} (want 2)")
    if proc.stdout:
        problems.append(f"the story started: stdout {proc.stdout!r}")
    if proc.stderr.splitlines() != [
        f"pgq: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]:
        problems.append(f"stderr {proc.stderr!r}")
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print("held: a taken port is one line and exit 2 before the demo starts")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
