"""SIGTERM/SIGINT that arrive while `pgq consume` is still importing kill it uncleanly.

What it shows: `pgq consume` installs its signal handlers only after Python has imported
pgq, SQLAlchemy, psycopg and click, which takes ~1 s on an idle machine and was measured
at 7 s ("member joined" 7 s after spawn) on the shared 2-core box under chaos load. A
SIGTERM in that window kills the process by the default action (exit status -15 / 143,
no log line at all); a SIGINT (Ctrl-C, `timeout -s INT`) prints a KeyboardInterrupt
traceback. A systemd/k8s stop or a restart loop right after a deploy hits exactly this
window.

Expected (DESIGN §4 "A signal that arrives while the consumer is still starting is
honoured"; §7 exits 0 when stopped by SIGTERM/SIGINT after a clean shutdown; never a
traceback): exit 0, no traceback. Actual: exit -15 for SIGTERM; traceback + exit 1 (or
-2) for SIGINT.

Run: .venv/bin/python scripts/attacks/signal_during_interpreter_startup.py (~10 s)
Exit 0 once fixed, 1 while the defect exists. Severity: cosmetic (nothing was claimed yet).
"""

import signal
import subprocess
import time

from _common import PGQ, Schema, verdict

import pgq

problems = []
with Schema("sigstart") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    for sig in (signal.SIGTERM, signal.SIGINT):
        for delay in (0.15, 0.4):
            p = subprocess.Popen(
                [PGQ, "consume", "g", "--handler", "attack_handlers:ok", "--name", "x"],
                env=s.env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(delay)
            p.send_signal(sig)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                problems.append(f"{sig.name} after {delay}s: did not exit within 30 s")
                continue
            if p.returncode != 0 or "Traceback" in err:
                tb = " with a traceback" if "Traceback" in err else ""
                problems.append(f"{sig.name} {delay}s after spawn: exit {p.returncode}{tb}")
verdict(problems, "a signal during start-up is a clean exit 0")
