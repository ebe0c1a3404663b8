"""Outages with real member processes (issue 10; DESIGN §6.4-6.5).

Real `pgq consume` processes share a simulated dependency that is down while
a flag file exists (tests/outage_slow_handlers.py, which also writes down every
call the outage failed, so the test knows the charged rows without asking the
database). The outage is real: the members fail the rows, trip, and open the
group. Then the dependency comes back, a prober closes the group and refunds
the outage's rows in batches of `RECONCILE_BATCH`, and here it is killed with
SIGKILL half-way, or the group is run from cron alone. Every wait is bounded.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import PGQ, finish, pin_frontier, rows, state_of, wait_until
from members import ConsumeProcesses, consume_processes
from sqlalchemy import Engine

import pgq
from pgq import monitor
from pgq.consumer.prober import RECONCILE_BATCH
from pgq.store import group_info, probe_lock_key

pytestmark = pytest.mark.slow

HANDLER = "outage_slow_handlers:recorded"

FAST = {
    "PGQ_WORKERS": 4,
    "PGQ_PREFETCH": 200,
    "PGQ_LEASE": 5,
    "PGQ_POLL_INTERVAL": 0.1,
    "PGQ_MAX_ATTEMPTS": 1,  # one systemic failure kills a row: outages charge fast
    "PGQ_RETRY_BACKOFF": 0.02,
    "PGQ_RETRY_BACKOFF_MAX": 0.05,
    "PGQ_BREAKER_OPEN_FOR": 0.5,
    "PGQ_BREAKER_OPEN_FOR_MAX": 1,
    "PGQ_BREAKER_HEARTBEAT": 0.2,
    "PGQ_BREAKER_MEMBER_TTL": 1.5,
    "PGQ_BREAKER_PROBE_INTERVAL": 0.3,
    "PGQ_BREAKER_PROBE_INTERVAL_MAX": 0.6,
}


class Members(ConsumeProcesses):
    """`pgq consume` processes of group `g` (topic `t`) and what their handlers wrote."""

    def __init__(self, engine: Engine, env: dict[str, str], out: Path) -> None:
        super().__init__(engine, env, out, HANDLER, FAST)

    def cron(self, name: str, timeout: float, **settings: object) -> tuple[int, str]:
        """One `--until-empty` run, as cron starts it: (exit code, its log)."""
        code, _, _ = finish(self.spawn(name, "--until-empty", **settings), timeout)
        return code, self.log_text(name)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        assert finish(proc, 10)[0] == -signal.SIGKILL

    def records(self, kind: str) -> dict[int, list[tuple[str, int]]]:
        """message id -> (member, attempt) of each handler call noted as `kind`."""
        seen: dict[int, list[tuple[str, int]]] = {}
        for path in self.out.glob(f"{kind}-*"):
            for line in path.read_text().splitlines():
                mid, tag, attempt = line.split()
                seen.setdefault(int(mid), []).append((tag, int(attempt)))
        return seen


@pytest.fixture
def members(engine: Engine, pgq_env: dict[str, str], tmp_path: Path) -> Iterator[Members]:
    with consume_processes(Members, engine, pgq_env, tmp_path, tail=30) as group:
        yield group


# -- who reconciles, and how far it got ------------------------------------------


class Reconciliation:
    """Reads the reconciliation owed by group `g` and the session electing its prober."""

    def __init__(self, engine: Engine, pg_dsn: str, schema: str) -> None:
        self.conn = psycopg.connect(pg_dsn, autocommit=True)
        key = probe_lock_key(schema, "g")
        self.params = {
            "gid": group_info(engine, "g").id,
            "classid": (key >> 32) & 0xFFFFFFFF,
            "objid": key & 0xFFFFFFFF,
        }
        self.sql = f"""
            SELECT b.reconcile_epoch, h.refunded,
                   (SELECT l.pid FROM pg_locks l
                     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                       AND l.classid = %(classid)s AND l.objid = %(objid)s
                       AND l.database = (SELECT oid FROM pg_database
                                          WHERE datname = current_database()))
              FROM "{schema}".breaker b
              LEFT JOIN "{schema}".breaker_history h
                ON h.group_id = b.group_id AND h.epoch = b.reconcile_epoch
             WHERE b.group_id = %(gid)s"""

    def now(self) -> tuple[int | None, int | None, int | None]:
        """(close epoch owed a reconciliation, rows refunded for it so far, the backend
        pid holding the probe lock): a reconciliation is in progress while the first
        is set."""
        found = self.conn.execute(self.sql, self.params).fetchone()
        assert found is not None
        return found[0], found[1], found[2]

    def process_of(self, backend: int, procs: dict[str, subprocess.Popen[str]]) -> str | None:
        """The name of the running process in `procs` whose connection `backend` is
        (None if that backend is gone). Read from `application_name` (members are
        started with `PGAPPNAME` set to their name), so it works over TCP and over a
        Unix socket alike: the latter has no client port."""
        found = self.conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (backend,)
        ).fetchone()
        if found is None:
            return None
        app = found[0] or ""
        # pgq's own name for a connection, `pgq/<group>/<member>/<role>`, wins over PGAPPNAME
        name = app.split("/")[2] if app.startswith("pgq/") and app.count("/") >= 3 else app
        proc = procs.get(name)
        return name if proc is not None and proc.poll() is None else None

    def close(self) -> None:
        self.conn.close()


def kill_the_reconciler(
    reconciliation: Reconciliation, group: Members, timeout: float
) -> tuple[str, int]:
    """SIGKILL the process holding the probe lock once its reconciliation has refunded
    at least one whole batch and is not finished; returns its name and the count."""
    names: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owed, refunded, holder = reconciliation.now()
        if holder is not None and holder not in names:
            name = reconciliation.process_of(holder, group.procs)
            if name is not None:
                names[holder] = name
        if owed is not None and holder in names and (refunded or 0) >= RECONCILE_BATCH:
            group.kill(names[holder])
            return names[holder], refunded or 0
        time.sleep(0.002)
    raise AssertionError(f"no reconciliation past one batch within {timeout:g}s")


# -- what every recovery must leave ------------------------------------------------


def charged_rows(group: Members) -> set[int]:
    return set(group.records("fail"))


def assert_recovered(
    group: Members, charged: set[int], poison: set[int], pin: int, published: int
) -> None:
    """Every charged row refunded exactly once by one close and done at attempt 1;
    everything else done, the poison dead; status agrees with the rows."""
    engine = group.engine
    final = rows(engine, "g")
    # a finished message's row goes with its refund (the ack deletes it): the charged rows
    # left carry theirs, the history and status count them all, and each charged row's
    # success at attempt 1 (below) shows its refund
    refunded = {mid for mid, r in final.items() if r.refunds}
    assert refunded == charged & final.keys(), (len(refunded), len(charged))
    assert {r.refunds for r in final.values()} <= {0, 1}
    history = monitor.breaker_info(engine, "g")["history"]
    assert [h["state"] for h in history] == ["CLOSED", "OPEN"], history
    assert history[0]["refunded"] == len(charged)

    assert {mid for mid, r in final.items() if r.state == "dead"} == poison
    assert all(final[mid].error_class == "message" for mid in poison)
    assert {mid for mid, r in final.items() if r.state not in ("done", "dead")} == {pin}
    assert all(state_of(final, mid) == "done" for mid in charged)

    # no row owed a refund ran before it: each ran (successfully) at attempt 1, except
    # the probe that closed the group if it was a charged row: it ran once, at the
    # attempt its charges gave it, and its success refunded it
    done, failed = group.records("done"), group.records("fail")
    late = {mid: done.get(mid) for mid in charged if {a for _, a in done.get(mid, [])} != {1}}
    assert len(late) <= 1, f"charged rows that did not run at attempt 1 after their refund: {late}"
    for mid, calls in late.items():
        assert calls == [(history[0]["by_member"], len(failed[mid]) + 1)], (mid, calls)

    s = pgq.status(engine, "g")
    assert s["breaker"]["state"] == "CLOSED"
    assert s["totals"]["refunded"] == len(charged)
    counts = s["counts"]
    assert (counts["dead"], counts["dead_systemic"], counts["leased"]) == (len(poison), 0, 0)
    assert (counts["ready"], s["lag"]) == (1, 1)  # the pin
    assert counts["done"] + counts["dead"] + counts["ready"] == published


# -- tests ----------------------------------------------------------------------------


def test_prober_killed_mid_reconciliation_another_member_finishes(
    members: Members, pg_dsn: str, schema: str
) -> None:
    # two trips open the group, so at least 2 x 5,000 rows die: three refund batches
    good, window = 20_000, RECONCILE_BATCH
    pin = pin_frontier(members.engine, "t")  # done rows stay readable
    pgq.publish_many(members.engine, "t", [{"i": i} for i in range(good)])
    poison = set(pgq.publish_many(members.engine, "t", [{"poison": True}] * 3))
    (members.out / "down").touch()
    for name in ("m1", "m2", "m3"):
        members.spawn(name, PGQ_BREAKER_WINDOW=window, PGQ_BREAKER_MIN_CALLS=window)

    def state() -> str:
        return pgq.status(members.engine, "g")["breaker"]["state"]

    wait_until(lambda: state() == "OPEN", 40, "the outage to open the group")
    wait_until(lambda: len(charged_rows(members)) > 2 * RECONCILE_BATCH, 10, "enough charges")
    reconciliation = Reconciliation(members.engine, pg_dsn, schema)
    try:
        (members.out / "down").unlink()
        victim, _ = kill_the_reconciler(reconciliation, members, 40)
        owed, refunded_after, _ = reconciliation.now()
        charged = charged_rows(members)
        assert owed is not None and refunded_after is not None, "killed too late"
        assert refunded_after < len(charged), (refunded_after, len(charged))

        survivors = set(members.procs) - {victim}
        wait_until(
            lambda: reconciliation.now()[0] is None, 30, "another member to finish the refunds"
        )
        wait_until(
            lambda: pgq.status(members.engine, "g")["lag"] == 1, 60, "the survivors to drain"
        )
    finally:
        reconciliation.close()
    finishers = [n for n in survivors if "reconciliation finished" in members.log_text(n)]
    assert finishers, "no surviving member logged the end of the reconciliation"
    history = monitor.breaker_info(members.engine, "g")["history"]
    assert history[0]["by_member"] == victim  # the killed member closed the group
    members.stop_all()
    assert charged == charged_rows(members)  # nothing failed after the dependency came back
    assert_recovered(members, charged, poison, pin, good + len(poison) + 1)


# -- cron only ------------------------------------------------------------------------


def cron_outage(group: Members, good: int, **settings: object) -> tuple[int, set[int]]:
    """A group run from cron alone, left OPEN by an outage that killed every row:
    one `--until-empty` run while the dependency is down. With `min_members` 1 its
    local trip is a group trip (a single-consumer deployment), and its window is the
    whole backlog, so it trips on the last row. Returns the pin and the charged rows."""
    pin = pin_frontier(group.engine, "t")
    pgq.publish_many(group.engine, "t", [{"i": i} for i in range(good)])
    (group.out / "down").touch()
    window = {"PGQ_BREAKER_WINDOW": good, "PGQ_BREAKER_MIN_CALLS": good}
    code, log = group.cron("outage", 60, **settings, **window)
    assert code == 75, log
    s = pgq.status(group.engine, "g")
    assert s["breaker"]["state"] == "OPEN", log
    assert (s["counts"]["dead_systemic"], s["counts"]["ready"]) == (good, 1)  # all, and the pin
    charged = charged_rows(group)
    assert len(charged) == good
    return pin, charged


def next_probe_in(engine: Engine) -> float:
    """Seconds until the stored probe time of `g` (database clock; negative when due)."""
    schema = engine.get_execution_options()["schema_translate_map"]["pgq"]
    with engine.connect() as conn:
        return conn.exec_driver_sql(
            f"SELECT extract(epoch FROM next_probe_at - now())::float"
            f' FROM "{schema}".breaker b JOIN "{schema}".consumer_group g'
            " ON g.id = b.group_id WHERE g.name = 'g'"
        ).scalar_one()


def test_cron_alone_recovers_an_open_group_whose_rows_all_died(
    members: Members, pgq_env: dict[str, str]
) -> None:
    good, interval = 6_000, 10.0  # two refund batches
    cron = {"PGQ_BREAKER_MIN_MEMBERS": 1, "PGQ_BREAKER_PROBE_INTERVAL": interval}
    cron["PGQ_BREAKER_PROBE_INTERVAL_MAX"] = interval
    pin, charged = cron_outage(members, good, **cron)

    # still down: the run probes (a dead row: nothing else is due) and fails. The
    # outage's own run may have probed once before it exited (on a loaded machine it
    # lives past the open): then the next probe is `interval` away
    wait_until(lambda: next_probe_in(members.engine) < 0, interval + 5, "the probe to be due")
    code, log = members.cron("down", 30, **cron)
    assert code == 75, log
    assert "probe failed" in log
    assert charged_rows(members) == charged  # it probed a row the outage had charged

    (members.out / "down").unlink()
    code, log = members.cron("early", 30, **cron)
    assert code == 75, log
    assert next_probe_in(members.engine) > 0  # it did not wait for the probe time
    s = pgq.status(members.engine, "g")
    assert s["breaker"]["state"] == "OPEN" and s["counts"]["dead_systemic"] == good
    assert not members.records("done")

    wait_until(lambda: next_probe_in(members.engine) < 0, interval + 5, "the probe to be due")
    code, log = members.cron("recover", 60, **cron)
    assert code == 0, log
    assert "stop_reason=empty" in log
    assert "by=probe" in log and "reconciliation finished" in log

    check = subprocess.run(
        [*PGQ, "check", "g"], env=pgq_env, capture_output=True, text=True, timeout=60
    )
    assert (check.returncode, check.stdout[:3]) == (0, "OK:"), check.stdout + check.stderr
    assert_recovered(members, charged, set(), pin, good + 1)


def test_cron_run_killed_mid_reconciliation_the_next_run_finishes_it(
    members: Members, pg_dsn: str, schema: str
) -> None:
    good = 12_000  # three refund batches
    cron = {"PGQ_BREAKER_MIN_MEMBERS": 1}
    pin, charged = cron_outage(members, good, **cron)
    (members.out / "down").unlink()  # the probe is due at once after the open

    reconciliation = Reconciliation(members.engine, pg_dsn, schema)
    try:
        members.spawn("first", "--until-empty", **cron)
        victim, _ = kill_the_reconciler(reconciliation, members, 40)
        assert victim == "first"
        owed, refunded, _ = reconciliation.now()
        assert owed is not None and refunded is not None and refunded < good, "killed too late"
    finally:
        reconciliation.close()

    code, log = members.cron("second", 60, **cron)
    assert code == 0, log
    assert "stop_reason=empty" in log and "reconciliation finished" in log
    assert charged_rows(members) == charged
    assert_recovered(members, charged, set(), pin, good + 1)


def test_next_prober_does_not_finish_while_a_killed_probers_batch_still_runs(
    members: Members, pg_dsn: str, schema: str
) -> None:
    """SIGKILL ends the prober's process, not its statement: the server runs the
    refund batch to its end and only then finds the client gone and rolls the batch
    back. Until then the batch holds its rows. Here the batch waits for the group
    row (this test holds it), so the next prober is elected and runs its own batch
    while the dead one's rows are still held: it must not take "nothing refunded"
    for "nothing left to refund", or those rows are never refunded."""
    good, window = 6_000, 1_000
    pin = pin_frontier(members.engine, "t")
    pgq.publish_many(members.engine, "t", [{"i": i} for i in range(good)])
    (members.out / "down").touch()
    for name in ("m1", "m2", "m3"):
        members.spawn(name, PGQ_BREAKER_WINDOW=window, PGQ_BREAKER_MIN_CALLS=window)
    wait_until(
        lambda: pgq.status(members.engine, "g")["breaker"]["state"] == "OPEN",
        40,
        "the outage to open the group",
    )
    assert len(charged_rows(members)) < RECONCILE_BATCH - 100  # one batch refunds them all

    reconciliation = Reconciliation(members.engine, pg_dsn, schema)
    holder = psycopg.connect(pg_dsn)
    waiting_batches = (  # refund batches waiting for a lock, the one this test blocks first
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE 'WITH batch AS%%'"
        " ORDER BY %s = ANY(pg_blocking_pids(pid)) DESC, xact_start"
    )

    def batches() -> list[int]:
        found = reconciliation.conn.execute(waiting_batches, (holder.info.backend_pid,))
        return [pid for (pid,) in found.fetchall()]

    try:
        # the group's state row: a refund batch updates its `refunded` total after its rows
        holder.execute(
            f'SELECT 1 FROM "{schema}".group_state WHERE group_id = %s FOR NO KEY UPDATE',
            (reconciliation.params["gid"],),
        )
        (members.out / "down").unlink()
        first = wait_until(batches, 30, "the prober's first batch to wait")[0]
        owed, refunded, _ = reconciliation.now()
        assert owed is not None and not refunded
        victim = reconciliation.process_of(first, members.procs)
        assert victim is not None
        members.kill(victim)
        wait_until(lambda: len(batches()) >= 2, 15, "the next prober's batch to wait behind it")
        assert batches()[0] == first  # the dead process's batch still holds its rows
        holder.rollback()  # the dead batch ends (rolled back), then the next one
        wait_until(lambda: reconciliation.now()[0] is None, 30, "the refunds to be finished")
    finally:
        holder.close()
        reconciliation.close()
    wait_until(lambda: pgq.status(members.engine, "g")["lag"] == 1, 60, "the survivors to drain")
    members.stop_all()
    assert_recovered(members, charged_rows(members), set(), pin, good + 1)
