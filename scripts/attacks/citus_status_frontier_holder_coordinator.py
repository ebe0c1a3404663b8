"""`pgq status`'s `frontier_held_by` on Citus reads the coordinator's `pg_stat_activity`,
but a group's frontier is held by the oldest transaction on the group's worker (0023,
section 5: the frontier counts in the worker's xids): status names the wrong backend.

One topic, group `g` on worker Y. (1) A transaction is opened on Y directly (`BEGIN;
SELECT pg_current_xact_id()`, as any worker-local job or a stuck prepared part would);
3 messages are published and drained by `pgq consume --until-empty`; the frontier stays
behind them (it may not pass Y's open xid). (2) That transaction ends and one is opened on
the coordinator alone (a coordinator-local xid); the frontier advances past everything.

Expected: (1) `frontier_held_by` names Y's backend (its pid, or at least not null / not a
coordinator backend) while the frontier is stalled; (2) it does not blame the
coordinator's transaction for a frontier that is not held.
Observed: printed; exit 1 when status names no holder or the wrong one.
"""

from __future__ import annotations

import json
import tempfile
import time

import psycopg
from citus_common import CitusSchema, node_dsn, verdict

import pgq
from pgq.sql import frontier as fsql


def advance(s: CitusSchema, gid: int) -> None:
    with s.engine.begin() as conn:
        conn.execute(fsql.without_jit())
        conn.execute(fsql.advance_frontier(), {"gid": gid})


def main() -> None:
    problems: list[str] = []
    with CitusSchema("holder") as s, tempfile.TemporaryDirectory() as tmp:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        y, gid = s.group_port("g"), s.gid("g")
        w = psycopg.connect(node_dsn(y), autocommit=False)
        wpid = w.execute("SELECT pg_backend_pid()").fetchone()[0]
        w.execute("SELECT pg_current_xact_id()")
        ids = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(3)])
        s.pgq("consume", "g", "--handler", "citus_handlers:record", "--until-empty",
                  timeout=60, ATK_DIR=tmp, ATK_TAG="g")  # fmt: skip
        advance(s, gid)
        st = json.loads(s.pgq("status", "--json", "g").stdout)
        print(f"(1) open xid on worker {y} pid {wpid}: committed {st['committed']} (last id {ids[-1]}),"
              f" counts {st['counts']}, frontier_held_by {st['frontier_held_by']}")  # fmt: skip
        held = st["frontier_held_by"]
        if st["committed"] != ids[-1] and (held is None or held.get("pid") != wpid):
            problems.append(
                f"frontier stalled at {st['committed']} by worker {y}'s backend {wpid};"
                f" status says frontier_held_by={held}"
            )
        w.rollback()
        w.close()
        c = psycopg.connect(
            s_dsn := "postgresql://postgres@127.0.0.1:9701/postgres", autocommit=False
        )
        cpid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        c.execute("SELECT pg_current_xact_id()")
        time.sleep(0.2)
        advance(s, gid)
        st = json.loads(s.pgq("status", "--json", "g").stdout)
        print(f"(2) open xid on the coordinator pid {cpid} ({s_dsn}): committed {st['committed']},"
              f" frontier_held_by {st['frontier_held_by']}")  # fmt: skip
        held = st["frontier_held_by"]
        if st["committed"] == ids[-1] and held is not None and held.get("pid") == cpid:
            problems.append(
                f"frontier at the last message {ids[-1]} (not held), yet status says it is held"
                f" by the coordinator's backend {cpid}: {held}"
            )
        c.rollback()
        c.close()
    verdict(problems, "status names what holds the frontier on Citus")


if __name__ == "__main__":
    main()
