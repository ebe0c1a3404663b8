"""A missing database, an unknown role or a DSN libpq refuses looks like an outage.

What it shows: `pgq consume --until-empty` (the cron entry) on a database that does not
exist, as a role that does not exist, with `sslmode=require` against a server without SSL
or with a misspelt option value (`sslmode=requir`) exits 75, EX_TEMPFAIL: "database
unavailable, try later". The cron notes tell people to count 75 as success, so a typo in
the DSN is ignored forever. The last two are even retried for `lease` seconds first, and
a long-running `pgq consume` retries them for ever.

Expected (DESIGN §7: a refused login, a missing database or a missing privilege is
configuration: exit 2 with the reason, never retried as an outage and never 75): exit 2
at once, one line naming the problem, no traceback. A wrong password behaves like the
unknown role (same code path); tests/acceptance/test_operation_errors.py provokes it on
a server of its own that asks for passwords.

Run: .venv/bin/python scripts/attacks/consume_refused_login_exits_75.py (~15 s with the
defect: lease is 4 s here). Exit 0 once fixed, 1 while the defect exists. Severity:
silent misconfiguration (a cron job that never runs and reports success).
"""

import secrets
import time

import psycopg
from _common import DSN, Schema, verdict

import pgq

CASES = {
    "missing database": {"dbname": f"atk_missing_{secrets.token_hex(3)}"},
    "unknown role": {"user": f"atk_nobody_{secrets.token_hex(3)}"},
    "misspelt sslmode": {"sslmode": "requir"},
    "sslmode=require without SSL": {"sslmode": "require"},
}

problems = []
with Schema("refused") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    for what, params in CASES.items():
        dsn = psycopg.conninfo.make_conninfo(DSN, **params)
        started = time.monotonic()
        r = s.pgq(
            *("consume", "g", "--handler", "attack_handlers:ok", "--until-empty"),
            timeout=30,
            PGQ_DSN=dsn,
            PGQ_LEASE=4,
        )
        took = time.monotonic() - started
        lines = r.stderr.strip().splitlines()
        if r.returncode != 2 or len(lines) != 1 or "Traceback" in r.stderr:
            problems.append(f"{what}: exit {r.returncode} after {took:.1f}s: {lines[-1:]}")
verdict(problems, "a refused login or database is exit 2 at once, never 75")
