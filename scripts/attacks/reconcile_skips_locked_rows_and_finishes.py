"""A reconciliation is declared finished while rows it owes a refund are locked by
another transaction: those rows are never refunded.

What it shows: `reconcile_batch` picks its rows `FOR UPDATE SKIP LOCKED`, and the
prober clears `reconcile_epoch` as soon as one batch refunds nothing. A batch that
refunds nothing because every row left is locked is taken for "nothing left".
The lock here is held by this script; in the wild it is a killed prober's own
batch: SIGKILL ends the process, not its statement, so the server runs the batch
to its end and only then rolls it back, while the next prober (elected at once,
the lock session dropped with the process) runs its batch, skips those rows,
refunds nothing and finishes. tests/acceptance/test_outage_processes.py
(`test_next_prober_does_not_finish_while_a_killed_probers_batch_still_runs`)
shows it with three real members: the whole outage's rows stay dead.

Expected (DESIGN §6.5: "if the prober dies half-way, the next leader finishes it"):
the reconciliation stays owed until every row it owes is refunded. Actual: it is
marked finished, the locked rows stay dead systemic (no close will refund them:
their failures are older than the next close's window) and `pgq check` turns
CRITICAL once the group is CLOSED.

Run: .venv/bin/python scripts/attacks/reconcile_skips_locked_rows_and_finishes.py (~10 s)
Exit 0 once fixed, 1 while the defect exists. Severity: lost refunds (rows stay dead).
"""

import subprocess
import time

from _common import PGQ, Schema, verdict
from sqlalchemy import text

import pgq

SET = dict(
    PGQ_LEASE="5",
    PGQ_POLL_INTERVAL="0.1",
    PGQ_BREAKER_HEARTBEAT="0.2",
    PGQ_BREAKER_MEMBER_TTL="1.5",
)
OWED, LOCKED = 50, 10


def wait(predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


problems = []
with Schema("reconcile_locked") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    pgq.publish(s.engine, "t", {"fresh": True})  # the probe takes it (due now, uncharged)
    owed = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(OWED)])
    # as an outage leaves them: dead of systemic failures, the group OPEN
    with s.engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE \"{s.name}\".delivery SET state = 'dead', error_class = 'systemic',"
                " error_epoch = 0, attempts = 1, refundable_attempts = 1, last_error = 'down'"
                " WHERE message_id = ANY(:ids)"
            ),
            {"ids": owed},
        )
        conn.execute(
            text(
                f"UPDATE \"{s.name}\".breaker SET state = 'OPEN', epoch = 1, next_probe_at = now()"
            )
        )

    def one(stmt, **params):
        return s.sql(stmt, **params)[0][0]

    holder = s.engine.connect()
    tx = holder.begin()
    holder.exec_driver_sql(
        f'SELECT 1 FROM "{s.name}".delivery WHERE message_id = ANY(%(ids)s) FOR UPDATE',
        {"ids": owed[:LOCKED]},
    )
    member = subprocess.Popen(
        [PGQ, "consume", "g", "--handler", "attack_handlers:ok", "--workers", "2"],
        env=s.env(**SET),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        closed = wait(
            lambda: one(f'SELECT count(*) FROM "{s.name}".breaker_history WHERE epoch = 2'),
            30,
        )
        if not closed:
            problems.append("setup: the member did not close the group within 30 s")
        # a fixed reconciler keeps it owed while the rows are locked: give it 5 s
        wait(lambda: one(f'SELECT reconcile_epoch IS NULL FROM "{s.name}".breaker'), 5)
        finished_early = one(f'SELECT reconcile_epoch IS NULL FROM "{s.name}".breaker')
        tx.rollback()  # the other transaction ends: its rows are free again
        holder.close()
        # settled: nothing ready or leased, and no reconciliation owed
        wait(
            lambda: one(
                f'SELECT NOT EXISTS (SELECT 1 FROM "{s.name}".delivery'
                " WHERE state IN ('ready', 'leased'))"
                f' AND (SELECT reconcile_epoch IS NULL FROM "{s.name}".breaker)'
            ),
            20,
        )
        left = s.sql(
            f'SELECT message_id, state, error_class, refunds FROM "{s.name}".delivery'
            " WHERE message_id = ANY(:ids) AND state <> 'done' ORDER BY message_id",
            ids=owed,
        )
        if left:
            problems.append(
                f"{len(left)} of {OWED} owed rows never refunded (the {LOCKED} locked ones:"
                f" {[tuple(r) for r in left[:3]]}...); reconciliation marked finished while"
                f" they were locked: {finished_early}"
            )
    finally:
        member.terminate()
        try:
            member.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            member.kill()
            member.communicate()

verdict(problems, "a reconciliation finishes only once every row it owes is refunded")
