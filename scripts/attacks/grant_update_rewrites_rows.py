"""`pgq grant --producer` lets the producer rename topics; `--consumer` lets it rewrite payloads.

What it shows: pgq never updates a `topic` or `message` row; the producer's and the
consumer's UPDATE on those tables (pgq/sql/privileges.py) exists only so that they may
lock rows (`FOR KEY SHARE` on the topic when publishing, retention's locks). But a
table-wide UPDATE lets a producer `UPDATE topic SET name = ...` (hijack or break every
topic) and a consumer `UPDATE message SET payload = ...` (forge any message of any
topic before another group handles it).

PostgreSQL lets a role lock rows with UPDATE on *one column* (checked: `GRANT UPDATE
(created_at) ON topic` is enough for FOR KEY SHARE and FOR UPDATE), so the least
privilege is a column grant on a column pgq never reads for decisions, e.g.
`UPDATE (created_at)` on `topic` and on `message`.

Run: .venv/bin/python scripts/attacks/grant_update_rewrites_rows.py (~5 s). Exit 1 while
the defect exists, 0 once fixed. Severity: least privilege (integrity).
"""

import secrets

import psycopg
from _common import DSN, Schema, verdict

import pgq

problems = []
roles = {job: f"atk_{job}_{secrets.token_hex(3)}" for job in ("producer", "consumer")}
with Schema("grantupd") as s, psycopg.connect(DSN, autocommit=True) as admin:
    try:
        for role in roles.values():
            admin.execute(f'CREATE ROLE "{role}"')
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        pgq.publish(s.engine, "t", {"amount": 10})
        for job, role in roles.items():
            r = s.pgq("grant", role, f"--{job}")
            if r.returncode != 0:
                problems.append(f"setup: pgq grant {role} --{job}: {r.stderr.strip()}")
        attempts = {
            "producer": f"UPDATE \"{s.name}\".topic SET name = 'hijacked'",
            "consumer": f'UPDATE "{s.name}".message SET payload = \'{{"amount": 1e9}}\'',
        }
        for job, stmt in attempts.items():
            with admin.transaction(force_rollback=True):
                admin.execute(f'SET LOCAL ROLE "{roles[job]}"')
                try:
                    n = admin.execute(stmt).rowcount
                except psycopg.errors.InsufficientPrivilege:
                    continue
                problems.append(f"a --{job} role ran {stmt!r}: {n} row(s) changed")
    finally:
        for role in roles.values():
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
verdict(problems, "a producer or consumer role cannot rewrite topics or payloads")
