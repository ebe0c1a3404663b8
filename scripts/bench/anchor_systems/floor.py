"""floor: a claim/ack loop written by hand with psycopg 3, no queue library.

A table of jobs with a status (0 queued, 1 claimed, 2 done) and a partial index
on the queued ones. Enqueue is one `COPY` and one commit per batch. A consumer
connection (autocommit) claims up to `claim` queued rows with one
`UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT claim)`, calls
the no-op handler on each, acks them all with one `UPDATE ... = ANY(ids)`, and
stops when a claim comes back empty. `conns` connections run that loop in as
many threads. No retries, leases, heartbeats or notifications: the upper bound
of Python + PostgreSQL claim/ack with durable commits, not a queue.
"""

from __future__ import annotations

import json
import threading
import traceback

import psycopg

from scripts.bench.common import Meter, batches

DDL = """
CREATE TABLE jobs (
    id      bigserial PRIMARY KEY,
    status  smallint NOT NULL DEFAULT 0,
    payload jsonb    NOT NULL
);
CREATE INDEX jobs_queued ON jobs (id) WHERE status = 0;
"""

CLAIM = """
UPDATE jobs SET status = 1
 WHERE id IN (SELECT id FROM jobs WHERE status = 0
               ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %s)
RETURNING id, payload
"""

ACK = "UPDATE jobs SET status = 2 WHERE id = ANY(%s)"


def enqueue(dsn: str, n: int, batch: int, opts: dict) -> dict:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
    rows = [json.dumps({"i": i}) for i in range(n)]  # outside the clock
    with psycopg.connect(dsn) as conn, Meter() as m:
        for rng in batches(n, batch):
            with conn.cursor() as cur, cur.copy("COPY jobs (payload) FROM STDIN") as copy:
                for i in rng:
                    copy.write_row((rows[i],))
            conn.commit()
    return m.as_dict("enqueue")


def consume(dsn: str, n: int, opts: dict) -> dict:
    conns = int(opts.get("conns", 1))
    claim = int(opts.get("claim", 100))
    seen: list[int] = []
    errors: list[str] = []

    def handle(job_id: int, payload: object) -> None:
        seen.append(job_id)

    def drain(conn: psycopg.Connection) -> None:
        try:
            while rows := conn.execute(CLAIM, (claim,)).fetchall():
                for job_id, payload in rows:
                    handle(job_id, payload)
                conn.execute(ACK, ([job_id for job_id, _ in rows],))
        except Exception:
            errors.append(traceback.format_exc())

    pool = [psycopg.connect(dsn, autocommit=True) for _ in range(conns)]  # opened untimed
    try:
        with Meter() as m:
            threads = [threading.Thread(target=drain, args=(c,)) for c in pool]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        for c in pool:
            c.close()
    if errors:
        raise RuntimeError(errors[0])
    with psycopg.connect(dsn) as conn:
        done, left = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 2), count(*) FILTER (WHERE status <> 2)"
            " FROM jobs"
        ).fetchone()
    return {
        **m.as_dict("consume"),
        "handler_calls": len(seen),
        "handler_distinct": len(set(seen)),
        "db_done": done,
        "db_done_distinct": done,  # id is the primary key
        "db_left": left,
        "config": f"{conns} thread(s) x 1 autocommit conn, claim {claim} per statement, "
        "1 ack statement per claim",
    }
