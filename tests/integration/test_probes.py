"""The group probe against real PostgreSQL with in-process consumers (DESIGN §6.4).

Each test puts the group in the state an outage leaves (OPEN, rows dead or
waiting) with plain SQL, then runs real `pgq.Consumer`s whose handler plays
the dependency. Group probes run in the prober's probe thread, so the handler
tells them from ordinary attempts by its thread name. Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psycopg
import pytest
from helpers import LONE_OUTAGE, pin_frontier, rows, wait_until, waiting_on
from sqlalchemy import Engine

import pgq
from pgq import monitor
from pgq.consumer.prober import PROBE_THREAD
from pgq.store import GroupStore, group_info, probe_lock, probe_lock_key, run_once

pytestmark = pytest.mark.slow

SHORT = LONE_OUTAGE


@dataclass
class Probes:
    """What the handler saw: every group probe as (monotonic time, message id)."""

    calls: list[tuple[float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, msg: pgq.Message) -> bool:
        """Record `msg` if it runs as a group probe; True when it does."""
        if threading.current_thread().name != PROBE_THREAD:
            return False
        with self.lock:
            self.calls.append((time.monotonic(), msg.id))
        return True

    def ids(self) -> list[int]:
        with self.lock:
            return [mid for _, mid in self.calls]

    def times(self) -> list[float]:
        with self.lock:
            return [at for at, _ in self.calls]


def sql(engine: Engine, statement: str, **params: object) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(statement, params or None)


def open_group(engine: Engine, schema: str, epoch: int = 1) -> None:
    """The group's breaker OPEN at `epoch`, its first probe due now."""
    sql(
        engine,
        f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = {epoch},"
        " next_probe_at = now(), probe_failures = 0",
    )


def kill_all_systemic(
    engine: Engine, schema: str, attempts: int, epoch: int = 0, where: str = "true"
) -> None:
    """Every row (matching `where`) dead of systemic failures, as the outage under
    `epoch` left it."""
    sql(
        engine,
        f"UPDATE \"{schema}\".delivery SET state = 'dead', error_class = 'systemic',"
        f" error_epoch = {epoch}, attempts = {attempts}, refundable_attempts = {attempts},"
        f" last_error = 'ConnectionError: dependency down' WHERE {where}",
    )


def breaker_state(engine: Engine) -> str:
    return str(pgq.status(engine, "g")["breaker"]["state"])


@pytest.fixture
def topic(engine: Engine) -> Engine:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    return engine


@pytest.fixture
def consumers() -> Iterator[Callable[..., pgq.Consumer]]:
    """Start in-process consumers of group `g`; all are stopped at the end."""
    started: list[pgq.Consumer] = []

    def start(engine: Engine, handler: Callable[[pgq.Message], None], **settings: object):
        consumer = pgq.Consumer(engine, "g", handler, **{**SHORT, **settings})
        consumer.start()
        started.append(consumer)
        return consumer

    yield start
    for consumer in started:
        consumer.stop(timeout=10)


# -- defect 1: one misclassified poison row cannot keep the group OPEN -----------------


def test_misclassified_poison_row_does_not_keep_a_dead_group_open(topic, schema, consumers):
    """One member, every row dead systemic, and the oldest row raises ConnectionError for
    itself alone while the dependency is back: probes rotate to another row, and the
    group closes within a bounded number of probes (before: every probe took the
    oldest dead row, the poison one, and the group stayed OPEN for good)."""
    engine = topic
    cursed = pgq.publish(engine, "t", {"cursed": True})
    healthy = pgq.publish_many(engine, "t", [{"i": i} for i in range(20)])
    kill_all_systemic(engine, schema, attempts=2)
    open_group(engine, schema)
    probes = Probes()

    def handler(msg: pgq.Message) -> None:
        probes.note(msg)
        if msg.payload.get("cursed"):
            raise ConnectionError("misclassified poison")

    started = time.monotonic()
    consumers(engine, handler, max_attempts=2, breaker_max_refunds=3)
    wait_until(
        lambda: breaker_state(engine) == "CLOSED",
        20,
        "the group to close",
        describe=lambda: (probes.ids(), pgq.status(engine, "g")["breaker"]),
    )
    time_to_close = time.monotonic() - started
    logging.getLogger(__name__).warning("time to close with one poison row: %.2fs", time_to_close)
    before_close = probes.ids()
    assert before_close[0] == cursed  # the oldest dead row goes first ...
    assert len(before_close) <= 2, before_close  # ... and the next probe rotates

    def drained() -> bool:
        dead = {mid for mid, r in rows(engine, "g").items() if r.state == "dead"}
        return dead == {cursed} and pgq.status(engine, "g")["lag"] == 0

    wait_until(drained, 30, "the healthy rows to be refunded and drained")
    final = rows(engine, "g")
    assert all(final[mid].state == "done" for mid in healthy if mid in final)


# -- defect 4: rows the user scheduled are never probed before their time ---------------


def test_delayed_and_snoozed_rows_are_not_probed_before_their_time(topic, schema, consumers):
    """While the group is OPEN and the dependency down, the probes take the systemic
    retry (ahead of its time: that is allowed) and never a row scheduled by the user
    (before: the probe took the ready row due soonest, whatever scheduled it)."""
    engine = topic
    delayed = pgq.publish(engine, "t", {"delayed": True}, delay=3600)
    snoozed, snoozed_after_failure, retry = pgq.publish_many(engine, "t", [{}, {}, {}])
    # snoozed by RetryLater(3600): no charge, the error class kept (none, or 'message')
    sql(
        engine,
        f"UPDATE \"{schema}\".delivery SET available_at = now() + interval '1 hour'"
        f" WHERE message_id = {snoozed}",
    )
    sql(
        engine,
        f"UPDATE \"{schema}\".delivery SET available_at = now() + interval '1 hour',"
        f" attempts = 1, error_class = 'message', error_epoch = 0, last_error = 'ValueError'"
        f" WHERE message_id = {snoozed_after_failure}",
    )
    # a systemic retry, due later than the user's rows
    sql(
        engine,
        f"UPDATE \"{schema}\".delivery SET available_at = now() + interval '2 hours',"
        " attempts = 1, refundable_attempts = 1, error_class = 'systemic', error_epoch = 0,"
        f" last_error = 'ConnectionError' WHERE message_id = {retry}",
    )
    open_group(engine, schema)
    probes = Probes()

    def handler(msg: pgq.Message) -> None:
        probes.note(msg)
        raise ConnectionError("dependency down")

    consumers(engine, handler, max_attempts=20)
    wait_until(lambda: len(probes.ids()) >= 3, 20, "three probes", describe=probes.ids)
    assert set(probes.ids()) == {retry}
    assert breaker_state(engine) == "OPEN"
    final = rows(engine, "g")
    for mid in (delayed, snoozed, snoozed_after_failure):
        assert (final[mid].state, final[mid].attempts) == (
            "ready",
            0 if mid != snoozed_after_failure else 1,
        )


# -- defect 3: inconclusive probes are paced and rotate --------------------------------


def test_inconclusive_probes_wait_the_probe_interval_and_take_another_row(topic, schema, consumers):
    """A dependency that answers every probe with a message-class error: each probe
    waits the probe interval (stored in the group row, not doubled) and takes another
    row (before: probes ran back to back, burning the backlog)."""
    engine = topic
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    open_group(engine, schema)
    probes = Probes()

    def handler(msg: pgq.Message) -> None:
        probes.note(msg)
        raise ValueError("the dependency says no")

    interval = SHORT["breaker_probe_interval"]
    consumers(engine, handler, max_attempts=50, retry_backoff=0.01, retry_backoff_max=0.01)
    wait_until(lambda: len(probes.ids()) >= 5, 20, "five probes", describe=probes.ids)
    times, seen = probes.times()[:5], probes.ids()[:5]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.8 * interval, gaps
    assert max(gaps) < 2 * interval + 0.5, gaps  # not doubled like a systemic failure's
    assert len(set(seen)) == 5 and set(seen) <= set(ids), seen
    info = pgq.status(engine, "g")["breaker"]
    assert info["state"] == "OPEN" and info["next_probe_at"] is not None
    with engine.connect() as conn:
        failures = conn.exec_driver_sql(f'SELECT probe_failures FROM "{schema}".breaker').scalar()
    assert failures == 0


# -- defect 10: the smaller ones --------------------------------------------------------


def test_prober_turns_count_consecutive_systemic_failures(topic, schema, consumers, caplog):
    """`breaker_prober_turns` = 2 and probes systemic, inconclusive, systemic, systemic:
    the prober sits out after the fourth probe, not the third (an inconclusive probe
    resets the count; before, it did not)."""
    engine = topic
    pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    open_group(engine, schema)
    probes = Probes()
    script = [ConnectionError, ValueError, ConnectionError, ConnectionError]

    def handler(msg: pgq.Message) -> None:
        if probes.note(msg):
            n = len(probes.ids())
            raise script[n - 1]("scripted") if n <= len(script) else ConnectionError("down")

    caplog.set_level(logging.INFO, logger="pgq.breaker")
    consumers(engine, handler, max_attempts=50, breaker_prober_turns=2)

    def sat_out() -> list[float]:
        return [r.created for r in caplog.records if "sits out" in r.getMessage()]

    wait_until(sat_out, 20, "the prober to sit out", describe=probes.ids)
    times = probes.times()
    assert len(times) >= 4, times
    assert sat_out()[0] > times[3] - 0.01, (sat_out(), times)


def test_successful_probe_clears_its_error_class_and_counts_its_refund(topic, schema, consumers):
    """The probe row that closed the group: done, error class cleared, its systemic
    charges refunded and counted in `refunded` and in the close's history row
    (before: error_class stayed 'systemic' and `refunded` stayed 0)."""
    engine = topic
    pin_frontier(engine, "t")  # keeps the done row from being pruned
    row = pgq.publish(engine, "t", {"i": 1})
    kill_all_systemic(engine, schema, attempts=2, where=f"message_id = {row}")
    open_group(engine, schema)
    consumers(engine, lambda msg: None)
    wait_until(lambda: rows(engine, "g")[row].state == "done", 20, "the probe to succeed")
    wait_until(lambda: breaker_state(engine) == "CLOSED", 20, "the group to close")
    done = rows(engine, "g")[row]
    assert (done.error_class, done.attempts, done.refundable_attempts) == (None, 1, 0)
    assert done.refunds == 1
    assert pgq.status(engine, "g")["totals"]["refunded"] == 1
    closes = [h for h in monitor.breaker_info(engine, "g")["history"] if h["state"] == "CLOSED"]
    assert [h["refunded"] for h in closes] == [1]


def lock_backends(engine: Engine, pg_dsn: str, schema: str) -> list[int]:
    """The backends holding the probe lock of group `g`."""
    key = probe_lock_key(schema, "g")
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
        ).fetchall()
    return [pid for (pid,) in found]


def terminate(pg_dsn: str, pid: int) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_status_names_no_prober_once_its_lock_is_lost(topic, schema, pg_dsn):
    """`pgq status` derives the prober from pg_locks: when the lock connection is gone
    the name goes with it (before: the stored name stayed)."""
    engine = topic
    open_group(engine, schema)
    info = group_info(engine, "g")
    store = GroupStore(info.id, "g", "t", "lonely", 30, 3)
    run_once(engine, store.join, 30.0, True)
    lock = probe_lock(engine, "g")
    try:
        assert lock.acquire()
        lock.run(store.set_prober)
        assert pgq.status(engine, "g")["breaker"]["prober"] == "lonely"
        (pid,) = lock_backends(engine, pg_dsn, schema)
        terminate(pg_dsn, pid)
        wait_until(lambda: not lock_backends(engine, pg_dsn, schema), 10, "the lock to go")
        assert pgq.status(engine, "g")["breaker"]["prober"] is None
    finally:
        lock.release()


def test_after_a_lock_loss_only_one_probe_runs_at_a_time(topic, schema, pg_dsn, consumers):
    """The prober's lock connection dies while its probe runs: another member wins the
    election but does not probe until that probe has finished (before: it probed at
    once, two probes in flight); the group then closes once."""
    engine = topic
    pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    open_group(engine, schema)
    spans: list[list[float]] = []
    release = threading.Event()

    def handler(msg: pgq.Message) -> None:
        if threading.current_thread().name != PROBE_THREAD:
            return
        span = [time.monotonic(), float("inf")]
        spans.append(span)
        if len(spans) == 1:
            release.wait(10)
        span[1] = time.monotonic()

    consumers(engine, handler, name="a", handler_timeout=5)
    wait_until(lambda: spans, 20, "the first probe to start")
    (first,) = lock_backends(engine, pg_dsn, schema)
    consumers(engine, handler, name="b", handler_timeout=5)
    terminate(pg_dsn, first)
    wait_until(
        lambda: [p for p in lock_backends(engine, pg_dsn, schema) if p != first],
        20,
        "another member to win the election",
    )
    # what is under test is that nothing happens: for 1.5 s, while the first probe
    # still runs, watch for a second one
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and len(spans) < 2:
        time.sleep(0.05)
    release.set()
    wait_until(lambda: breaker_state(engine) == "CLOSED", 30, "the group to close")
    ordered = sorted(spans)
    for earlier, later in itertools.pairwise(ordered):
        assert later[0] >= earlier[1], ordered
    closes = [h for h in monitor.breaker_info(engine, "g")["history"] if h["state"] == "CLOSED"]
    assert len(closes) == 1


def test_a_probe_slot_renewed_late_is_reported(topic, schema, consumers, caplog):
    """The prober's renewal of its probe slot stalls past `member_ttl` (here: another
    session holds the breaker row; in the field: a stalled connection): the slot
    lapsed meanwhile and another member could have probed, so the prober says so
    (before: the stalled renewal simply went through, silently)."""
    engine = topic
    pgq.publish_many(engine, "t", [{"i": i} for i in range(3)])
    open_group(engine, schema)
    started, finish = threading.Event(), threading.Event()

    def handler(msg: pgq.Message) -> None:
        if threading.current_thread().name == PROBE_THREAD:
            started.set()
            finish.wait(30)  # the probe runs until the renewal has come back late

    caplog.set_level(logging.WARNING, logger="pgq.breaker")
    consumers(engine, handler, name="a")
    try:
        assert started.wait(20), "no probe started"
        ttl = SHORT["breaker_member_ttl"]
        with engine.connect() as blocker, blocker.begin():
            blocker.exec_driver_sql(f'SELECT 1 FROM "{schema}".breaker FOR UPDATE')
            pid = blocker.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            wait_until(
                lambda: waiting_on(engine, pid, "%next_probe_at%"),
                20,
                "the renewal to wait on the breaker row",
            )
            # the stall under test: the renewal comes back well past `member_ttl`
            time.sleep(ttl * 1.8)
        wait_until(
            lambda: "probe slot not renewed in time" in caplog.text,
            10,
            "the late renewal's warning",
        )
    finally:
        finish.set()


# -- the probe log ----------------------------------------------------------------------


def test_the_probe_log_lists_every_probe_of_an_outage(topic, consumers):
    """A real member trips the group open; its probes fail (systemic), fail, are
    inconclusive (a message error), then succeed and close. `breaker_info` lists
    each, newest first, under the OPEN epoch, with the prober and the message it
    ran (before: no probe was recorded anywhere)."""
    engine = topic
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(20)])
    probes = Probes()
    script = [ConnectionError, ConnectionError, ValueError]  # then the dependency is back
    down = threading.Event()
    down.set()

    def handler(msg: pgq.Message) -> None:
        if probes.note(msg):
            n = len(probes.ids())
            if n == len(script):
                down.clear()
            if n <= len(script):
                raise script[n - 1]("scripted")
        elif down.is_set():
            raise ConnectionError("dependency down")

    consumers(engine, handler, name="prober-a", max_attempts=50)
    wait_until(
        lambda: len(probes.ids()) > len(script) and breaker_state(engine) == "CLOSED",
        30,
        "the probes to fail, then succeed and close",
        describe=probes.ids,
    )
    info = monitor.breaker_info(engine, "g")
    opened = [h["epoch"] for h in info["history"] if h["state"] == "OPEN"]
    assert opened == [1], info["history"]
    logged = info["probes"]
    assert [p["outcome"] for p in logged] == ["succeeded", "inconclusive", "failed", "failed"]
    assert [p["error_class"] for p in logged] == [None, "message", "systemic", "systemic"]
    assert [p["message_id"] for p in logged] == probes.ids()[::-1]
    assert set(probes.ids()) <= set(ids)
    for p in logged:
        assert (p["epoch"], p["member"]) == (1, "prober-a"), p
        assert isinstance(p["at"], str) and p["at"].endswith("+00:00"), p
    ats = [p["at"] for p in logged]
    assert ats == sorted(ats, reverse=True)
    # the newest ones first, cut by the limit
    assert monitor.breaker_info(engine, "g", probe_limit=1)["probes"] == logged[:1]


def test_retention_deletes_the_groups_old_probes(topic, schema):
    """A member's retention pass deletes its group's probes older than `retention` and
    keeps the younger ones and other groups' (before: there was no probe log)."""
    engine = topic
    pgq.subscribe(engine, "other", "t")
    sql(
        engine,
        f'INSERT INTO "{schema}".probe (group_id, epoch, at, member, outcome)'
        " SELECT c.id, 1, now() - make_interval(mins => h * 60 - 30), 'm', 'failed'"
        f' FROM "{schema}".consumer_group c, generate_series(1, 48) AS h',
    )
    summary = pgq.Consumer(engine, "g", lambda msg: None, **SHORT, retention=86400).run(
        until_empty=True
    )
    assert summary.stop_reason == "empty"
    with engine.connect() as conn:
        left = conn.exec_driver_sql(
            f'SELECT c.name, count(*) FROM "{schema}".probe p'
            f' JOIN "{schema}".consumer_group c ON c.id = p.group_id GROUP BY c.name'
        ).all()
    assert dict(left) == {"g": 24, "other": 48}  # the g ones 0.5 to 23.5 hours old
    assert len(monitor.breaker_info(engine, "g", probe_limit=100)["probes"]) == 24


# -- a probe's outcome written, its answer lost -----------------------------------------

COMMIT_LOCK = (20_517, 9)
"""The advisory lock (two-int form) a transaction that ends a lease waits for at its
COMMIT, while `commits_wait` is in place and the test holds it."""


def commits_wait(engine: Engine, schema: str) -> None:
    """A deferred trigger: every transaction that ends a lease of `delivery` waits, at
    its COMMIT, for `COMMIT_LOCK` (a test that holds it holds such commits there)."""
    key = ", ".join(map(str, COMMIT_LOCK))
    sql(
        engine,
        f'CREATE FUNCTION "{schema}".commit_waits() RETURNS trigger LANGUAGE plpgsql'
        f" AS $$ BEGIN PERFORM pg_advisory_xact_lock_shared({key}); RETURN NULL; END $$",
    )
    sql(
        engine,
        f'CREATE CONSTRAINT TRIGGER commit_waits AFTER UPDATE ON "{schema}".delivery'
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
        " WHEN (OLD.lease_owner IS NOT NULL AND NEW.lease_owner IS NULL)"
        f' EXECUTE FUNCTION "{schema}".commit_waits()',
    )


def commit_waiting(holder: psycopg.Connection) -> bool:
    """Whether a transaction of this database waits at its COMMIT for `COMMIT_LOCK`."""
    found = holder.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database db ON db.oid = l.database"
        " WHERE db.datname = current_database() AND l.locktype = 'advisory'"
        " AND l.classid = %s AND l.objid = %s AND l.objsubid = 2 AND NOT l.granted",
        COMMIT_LOCK,
    ).fetchone()
    return found is not None and found[0] > 0


LOST_ANSWERS = {
    # the first probe: what the handler does, and the run's counts at the end
    # (handled, done, retried, dead, refused); a failed first probe is followed by one
    # that succeeds and closes the group
    "succeeds": (1, 1, 0, 0, 0),
    "fails": (2, 1, 1, 0, 0),
    "fails_on_a_dead_row": (2, 1, 0, 1, 0),  # stays dead, no attempt charged
}


@pytest.mark.parametrize("first", list(LOST_ANSWERS))
def test_a_probe_outcome_whose_answer_was_lost_counts_as_written(topic, schema, pg_dsn, first):
    """The probe's outcome (with the close, for a success) commits, but the connection is
    cut before its answer arrives: the retry finds the lease gone, and the outcome must
    count as written, as the handler said (before: "probe outcome refused ... (lease
    lost)", counted in `refused`). Deterministic: the probe's COMMIT waits for a lock the
    test holds (`commits_wait`); the proxy stalls, the lock goes, the commit is seen in
    the database, and only then is the connection cut."""
    from chaos.proxy import Proxy

    engine = topic
    pin_frontier(engine, "t")  # keeps the probe's done row readable
    mid = pgq.publish(engine, "t", {"n": 1})
    max_attempts = 3
    if first == "fails_on_a_dead_row":
        kill_all_systemic(engine, schema, max_attempts, where=f"message_id = {mid}")
    open_group(engine, schema)
    commits_wait(engine, schema)
    probes = Probes()

    def handler(msg: pgq.Message) -> None:
        if probes.note(msg) and first != "succeeds" and len(probes.ids()) == 1:
            raise ConnectionError("dependency still down")

    def lease_ended() -> bool:
        return rows(engine, "g")[mid].lease_owner is None

    with (
        psycopg.connect(pg_dsn, autocommit=True) as holder,
        Proxy.for_dsn(pg_dsn) as proxy,
    ):
        holder.execute("SELECT pg_advisory_lock(%s, %s)", COMMIT_LOCK)
        through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
        consumer = pgq.Consumer(through, "g", handler, **{**SHORT, "max_attempts": max_attempts})
        consumer.start()
        try:
            wait_until(lambda: commit_waiting(holder), 20, "the probe's commit to wait")
            proxy.stall()  # the commit's answer stays in the proxy
            holder.execute("SELECT pg_advisory_unlock(%s, %s)", COMMIT_LOCK)
            wait_until(lease_ended, 10, "the probe's outcome to commit")
            proxy.cut()  # the answer is lost
            proxy.resume()
            wait_until(
                lambda: not consumer.breaker_states()["group_breaker"],
                30,
                "the member to see the group closed",
                describe=lambda: (probes.ids(), pgq.status(engine, "g")["breaker"]),
            )
            view = consumer._gate.epoch if consumer._gate is not None else None
        finally:
            summary = consumer.stop(timeout=10)
            through.dispose()
    breaker = pgq.status(engine, "g")["breaker"]
    assert (breaker["state"], breaker["epoch"], view) == ("CLOSED", 2, 2), breaker
    counts = LOST_ANSWERS[first]
    assert probes.ids() == [mid] * counts[0]
    row = rows(engine, "g")[mid]
    assert (row.state, row.attempts, row.lease_owner) == ("done", 1, None)
    found = (summary.handled, summary.done, summary.retried, summary.dead, summary.refused)
    assert found == counts, summary
