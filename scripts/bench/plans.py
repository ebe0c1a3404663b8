"""How PostgreSQL plans pgq's hot statements: the bench's one internal hook.

`explain_paths` is the only place the bench touches pgq's internals, and it
does so on purpose: to EXPLAIN the claim and the ack it needs the statements
themselves, so it reads pgq's statement catalogue (`pgq.sql.claim.claim`,
`pgq.sql.outcomes.ack_done`), compiles them the way the store's hot path does
(`pgq.store.run_hot`: the schema rendered in, psycopg's named placeholders),
and leases real rows through `pgq.store.GroupStore` (found with
`pgq.store.group_info`; arrays passed as `pgq.store.scope.int_array` text, as
the store sends them). Those imports sit inside the function, so a move of the
internals breaks only the EXPLAIN of `backlog`, never the rest of the bench.

`prepared_plans` needs no internals: it reads `pg_prepared_statements` on the
engine's pooled sessions and tells the claim from the ack by their SQL text.
"""

from __future__ import annotations

import re
from typing import Any

from psycopg import sql as psql

from scripts.bench.common import GROUP, SCHEMA

EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS) "
PLAN_ROWS = 100
"""Rows each EXPLAINed claim and ack touches."""


def _placeholders(sql_text: str) -> list[str]:
    """psycopg's named placeholders in order of first appearance (= its $1, $2, ...)."""
    names: list[str] = []
    for name in re.findall(r"%\((\w+)\)s", sql_text):
        if name not in names:
            names.append(name)
    return names


def _explain_generic(raw: Any, sql_text: str, warm: dict, params: dict) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of `sql_text` run as a PREPARED statement with the
    generic plan (the plan a prepared statement keeps once PostgreSQL stops making
    custom plans; pgq's hot statements are prepared by psycopg after 5 runs).

    The statement is prepared by psycopg itself (`prepare=True`, run once with
    `warm`), found in `pg_prepared_statements`, then `EXPLAIN ... EXECUTE name(...)`
    with `params` as literals under `plan_cache_mode = force_generic_plan`.
    """
    with raw.cursor() as cur:
        cur.execute(sql_text, warm, prepare=True)
    name = raw.execute(
        "SELECT name FROM pg_prepared_statements WHERE NOT from_sql"
        " ORDER BY prepare_time DESC LIMIT 1"
    ).fetchone()[0]
    args = ", ".join(psql.Literal(params[k]).as_string(raw) for k in _placeholders(sql_text))
    raw.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    try:
        plan = raw.execute(f"{EXPLAIN}EXECUTE {name}({args})").fetchall()
    finally:
        raw.execute("SET LOCAL plan_cache_mode = auto")
    return "\n".join(r[0] for r in plan)


def _explain(raw: Any, sql_text: str, params: dict) -> str:
    plan = raw.execute(EXPLAIN + sql_text, params).fetchall()
    return "\n".join(r[0] for r in plan)


def explain_paths(engine: Any, schema: str = SCHEMA) -> dict[str, str]:
    """EXPLAIN (ANALYZE, BUFFERS) of pgq's own claim and ack statements, rolled back.

    In one transaction: lease 4 × 100 rows through `GroupStore.claim`, then, each
    on rows no other step touched:

    * `claim` / `ack`: EXPLAIN ANALYZE of the statement with its parameters (a
      custom plan, made for these values);
    * `claim (generic plan)` / `ack (generic plan)`: the same statement as a
      prepared statement forced onto its generic plan (see `_explain_generic`):
      what a consumer runs once PostgreSQL settles on the generic plan.

    Claims are for 100 rows, acks for 100 of the leased rows. Everything is rolled
    back; the connection is thrown away after (it holds a prepared statement
    psycopg does not know about any more).
    """
    # the internal hook (see the module docstring)
    from pgq.schema import SCHEMA_PLACEHOLDER
    from pgq.sql.claim import claim
    from pgq.sql.outcomes import ack_done
    from pgq.store import GroupStore, group_info
    from pgq.store.scope import int_array

    info = group_info(engine, GROUP)
    store = GroupStore(info.id, GROUP, info.topic, "bench-explain", 30.0, 3)
    known = {"gid": store.gid, "member": store.member, "lease": store.lease, "token": -1}

    def compiled(stmt: Any, conn: Any) -> tuple[str, dict[str, Any]]:
        """The SQL text and parameters as `pgq.store.run_hot` sends them."""
        c = stmt.compile(
            dialect=conn.dialect,
            schema_translate_map={SCHEMA_PLACEHOLDER: schema},
            render_schema_translate=True,
        )
        required = {name for name, bind in c.binds.items() if bind.required}
        missing = required - set(known) - {"ids", "seqs"}
        if missing:
            raise RuntimeError(f"pgq's statement binds {sorted(missing)}: teach bench/plans.py")
        return c.string, {**dict(c.params), **known}

    def acks(params: dict[str, Any], rows: list) -> dict[str, Any]:
        return {
            **params,
            "ids": int_array(r.id for r in rows),
            "seqs": int_array(r.seq for r in rows),
        }

    out: dict[str, str] = {}
    c = engine.connect()
    tx = c.begin()
    try:
        rows = store.claim(c, 4 * PLAN_ROWS, 0)
        claim_sql, claim_params = compiled(claim(PLAN_ROWS), c)
        ack_sql, ack_params = compiled(ack_done(), c)
        raw = c.connection.driver_connection
        out["claim"] = _explain(raw, claim_sql, claim_params)
        full = len(rows) >= 4 * PLAN_ROWS
        if full:
            out["ack"] = _explain(raw, ack_sql, acks(ack_params, rows[:PLAN_ROWS]))
        out["claim (generic plan)"] = _explain_generic(raw, claim_sql, claim_params, claim_params)
        if full:
            out["ack (generic plan)"] = _explain_generic(
                raw,
                ack_sql,
                acks(ack_params, rows[PLAN_ROWS : 2 * PLAN_ROWS]),
                acks(ack_params, rows[2 * PLAN_ROWS : 3 * PLAN_ROWS]),
            )
    finally:
        tx.rollback()
        c.invalidate()
        c.close()
    return out


def statement_kind(sql_text: str) -> str:
    """`claim`, `ack` or `other`, from the text of a prepared statement."""
    if "SKIP LOCKED" in sql_text and "UPDATE" in sql_text:
        return "claim"
    if "SET state='done'" in sql_text:
        return "ack"
    return "other"


def prepared_plans(engine: Any) -> dict[str, dict[str, int]]:
    """How often PostgreSQL used a generic vs a custom plan for pgq's prepared hot
    statements, summed over the sessions idle in the engine's pool (after a run:
    the fetcher's and the acker's connections are back there).

    `pg_prepared_statements` is per session, so every pooled connection is checked
    out at once and asked.
    """
    out: dict[str, dict[str, int]] = {}
    held = []
    try:
        for _ in range(engine.pool.checkedin()):
            held.append(engine.raw_connection())
        for dbapi in held:
            cur = dbapi.cursor()
            cur.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
            for stmt, generic, custom in cur.fetchall():
                k = out.setdefault(
                    statement_kind(stmt), {"generic": 0, "custom": 0, "statements": 0}
                )
                k["generic"] += int(generic)
                k["custom"] += int(custom)
                k["statements"] += 1
            cur.close()
    finally:
        for dbapi in held:
            dbapi.close()
    return out
