"""Two `pgq grant` runs at once fail with "database error: tuple concurrently updated".

What it shows: GRANT rewrites the ACL of each table's catalog row; two transactions
granting on the same table at once make PostgreSQL raise XX000 "tuple concurrently
updated" in one of them. Deployments run `pgq grant` after every `pgq init`
(decision 0018), e.g. one per service starting at the same time: some exit 1 with
`pgq: error: database error: tuple concurrently updated`, an error that says nothing
useful, for an idempotent command that has nothing wrong with its input.

Expected: concurrent grants all succeed (exit 0). Fix: serialise `_grant` in
pgq/store/privileges.py with a transaction-level advisory lock on a key derived
from the schema (`SELECT pg_advisory_xact_lock(<schema key>)` before the GRANTs),
as `migrate` does for concurrent `pgq init`.

Run: .venv/bin/python scripts/attacks/grant_concurrent_fails.py (~20 s). Exit 1 while
the defect exists, 0 once fixed. Severity: spurious failure (deploy step fails).
"""

import secrets
import subprocess

import psycopg
from _common import DSN, PGQ, Schema, verdict

ROUNDS, RUNNERS = 5, 6
problems = []
roles = [f"atk_g{i}_{secrets.token_hex(3)}" for i in range(RUNNERS)]
with Schema("grantrace") as s, psycopg.connect(DSN, autocommit=True) as admin:
    try:
        for role in roles:
            admin.execute(f'CREATE ROLE "{role}"')
        for _ in range(ROUNDS):
            procs = [
                subprocess.Popen(
                    [PGQ, "grant", role, "--consumer"],
                    env=s.env(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for role in roles
            ]
            for p in procs:
                _, err = p.communicate(timeout=60)
                if p.returncode != 0:
                    problems.append(f"exit {p.returncode}: {err.strip()}")
            for role in roles:
                admin.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{s.name}" FROM "{role}"')
    finally:
        for role in roles:
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
verdict(problems, "concurrent pgq grant runs all succeed")
