"""A consumer role without a privilege it needs runs on silently, or crashes.

What it shows: a login role with every table privilege on the schema except one.
- Without UPDATE on `breaker`, `pgq consume --until-empty` drains and exits 0: the member
  can never open the group's breaker (nor probe, nor close it), and nobody is told.
- Without DELETE on `delivery` (pruning), a long-running `pgq consume` runs for ever,
  logging a traceback every minute from its maintenance tasks.
- Without SELECT on `message`, the fetcher crashes: exit 1 with a traceback.

Expected (DESIGN §7: a missing privilege is configuration: exit 2 with the reason, never
a traceback; issue 11: a member that cannot do its job must stop with a clear error):
exit 2 at once, one line naming the privilege and the table.

Run: .venv/bin/python scripts/attacks/consume_missing_privilege_silent.py (~15 s; the
long-running case is killed after 8 s). Exit 0 once fixed, 1 while the defect exists.
Severity: silent misconfiguration (a group whose breaker can never open).
"""

import secrets

import psycopg
from _common import DSN, Schema, verdict

import pgq

CASES = [
    ("breaker", "UPDATE", ["--until-empty"]),
    ("delivery", "DELETE", []),
    ("message", "SELECT", ["--until-empty"]),
]


def ddl(s: Schema, statement: str) -> None:
    with s.engine.begin() as conn:
        conn.exec_driver_sql(statement)


problems = []
with Schema("privilege") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    for table, privilege, flags in CASES:
        pgq.publish(s.engine, "t", {"n": 1})
        role = f"atk_role_{secrets.token_hex(3)}"
        ddl(s, f"CREATE ROLE \"{role}\" LOGIN PASSWORD 'atk'")
        try:
            ddl(s, f'GRANT USAGE ON SCHEMA "{s.name}" TO "{role}"')
            ddl(s, f'GRANT ALL ON ALL TABLES IN SCHEMA "{s.name}" TO "{role}"')
            ddl(s, f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{s.name}" TO "{role}"')
            ddl(s, f'REVOKE {privilege} ON "{s.name}".{table} FROM "{role}"')
            dsn = psycopg.conninfo.make_conninfo(DSN, user=role, password="atk")
            r = s.pgq(
                "consume", "g", "--handler", "attack_handlers:ok", *flags, timeout=8, PGQ_DSN=dsn
            )
            last = (r.stderr.strip().splitlines() or [""])[-1]
            named = privilege in last and table in last
            if r.returncode != 2 or "Traceback" in r.stderr or not named:
                what = " ".join(["consume", *flags])
                problems.append(
                    f"no {privilege} on {table}, {what}: exit {r.returncode}: {last[:160]}"
                )
        finally:
            s.sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r", r=role
            )
            ddl(s, f'DROP OWNED BY "{role}"')
            ddl(s, f'DROP ROLE "{role}"')
verdict(problems, "a missing privilege is exit 2 at once, naming it")
