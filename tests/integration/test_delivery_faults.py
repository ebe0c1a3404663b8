"""Delivery faults of the consumer itself (issue 9): stale outcomes, outcomes the
database refuses, interrupted runs, early stops, waiting for retries.

Each test drives a real `Consumer` against the real database; what another member
or a crash would do to a row is done with the statements such a member runs.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import logging
import threading
import time

import pytest
from helpers import FAST, pin_frontier, rows, state_of, states, wait_until, waiting_on
from sqlalchemy import Engine, text

import pgq

WAIT = 30.0


def _reclaim_as_another_member(engine: Engine, schema: str, mid: int) -> None:
    """What another member's sweep does to an expired lease: ready again, one reclaim."""
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'ready', lease_owner = NULL,"
                " lease_expires_at = NULL, reclaims = reclaims + 1, available_at = now()"
                " WHERE message_id = :id"
            ),
            {"id": mid},
        )


def test_a_stale_outcome_does_not_drop_the_members_newer_lease(orders, schema):
    """Defect 4: a member whose row was reclaimed re-claims it; its stale outcome is
    refused, and that must not drop its newer lease (which then stops being
    extended, expires, is reclaimed again ... until the message dies as `lease`)."""
    engine = orders
    pin_frontier(engine, "orders")  # keeps the done row from being pruned
    mid = pgq.publish(engine, "orders", {"n": 1})
    starts: list[float] = []
    second_started = threading.Event()

    def handler(message: pgq.Message) -> None:
        starts.append(time.monotonic())
        if len(starts) == 1:
            # the first attempt outlives its lease: another member reclaims the row,
            # and this member claims it again before the first attempt returns
            _reclaim_as_another_member(engine, schema, mid)
            assert second_started.wait(WAIT)
            return
        second_started.set()
        time.sleep(2.5)  # longer than the lease: only extension keeps it

    consumer = pgq.Consumer(
        engine, "billing", handler, workers=2, lease=1.0, max_reclaims=3, **FAST
    )
    consumer.start()
    try:
        wait_until(
            lambda: rows(engine, "billing")[mid].state in ("done", "dead"),
            WAIT,
            "the message to be resolved",
        )
    finally:
        summary = consumer.stop(timeout=10)
    row = rows(engine, "billing")[mid]
    assert (row.state, row.reclaims) == ("done", 1), (row.state, row.reclaims, row.last_error)
    assert len(starts) == 2
    assert (summary.done, summary.refused) == (1, 1)


def test_outcomes_the_database_refuses_do_not_take_the_batch_with_them(orders):
    """Defect 6: a NUL byte or a lone surrogate in an error text, a non-finite snooze:
    the acker writes the rest of the batch and records those attempts sanely."""
    engine = orders
    bad = {
        "nul": ValueError("bad\x00text"),
        "surrogate": ValueError("bad \udc80 text"),
        "inf": pgq.RetryLater(float("inf")),
        "nan": pgq.RetryLater(float("nan")),
    }
    pin_frontier(engine, "orders")
    ids = pgq.publish_many(engine, "orders", [{"kind": k} for k in bad] + [{"kind": "ok"}] * 10)
    ran: list[tuple[int, int]] = []

    def handler(message: pgq.Message) -> None:
        kind = message.payload["kind"]
        if kind != "ok":
            raise bad[kind]
        ran.append((message.id, message.attempt))

    consumer = pgq.Consumer(engine, "billing", handler, workers=4, max_attempts=1, **FAST)
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    assert summary.stop_reason == "empty"
    assert consumer.clean
    assert summary.done == 10
    assert sorted(ran) == [(mid, 1) for mid in ids[4:]]  # each ran once
    found = rows(engine, "billing")
    assert {state_of(found, mid) for mid in ids[4:]} == {"done"}
    by_kind = dict(zip(bad, ids[:4], strict=True))
    for kind, mid in by_kind.items():
        assert (found[mid].state, found[mid].error_class) == ("dead", "message"), kind
    assert "\\x00" in found[by_kind["nul"]].last_error
    assert "\\udc80" in found[by_kind["surrogate"]].last_error
    assert "RetryLater" in found[by_kind["inf"]].last_error
    assert "inf" in found[by_kind["inf"]].last_error
    assert "nan" in found[by_kind["nan"]].last_error


def _raise_in(thread: threading.Thread, exc: type[BaseException]) -> None:
    ident = thread.ident
    assert ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))
    assert done == 1


def test_an_exception_in_the_run_thread_shuts_the_member_down_then_propagates(orders):
    """Defect 9: KeyboardInterrupt (or an orchestrator's cancellation) in the thread
    blocked in `run()` must release buffered rows, leave the group, and re-raise."""
    engine = orders
    pin_frontier(engine, "orders")  # one more ready row, waiting for an hour
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(20)])
    started = threading.Event()
    release = threading.Event()

    def handler(message: pgq.Message) -> None:
        started.set()
        assert release.wait(WAIT)

    consumer = pgq.Consumer(engine, "billing", handler, workers=1, prefetch=4, **FAST)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(WAIT)
    wait_until(lambda: states(engine, "billing")["leased"] >= 3, WAIT, "buffered rows")
    _raise_in(runner, KeyboardInterrupt)
    threading.Timer(0.5, release.set).start()  # the running handler finishes in the grace
    runner.join(WAIT)
    assert not runner.is_alive()
    assert [type(e) for e in raised] == [KeyboardInterrupt]
    counts = states(engine, "billing")
    assert (counts["leased"], counts["done"], counts["ready"]) == (0, 1, 20)
    status = pgq.status(engine, "billing", member_ttl=FAST["breaker_member_ttl"])
    assert [m["live"] for m in status["members"]] == [False]
    assert status["totals"]["released"] >= 3
    assert consumer.stop().done == 1  # after the shutdown, stop() only reports


def test_a_stop_asked_for_while_starting_is_honoured(pg_dsn, schema, caplog):
    """Defect 8: a stop asked for while the member is still starting (here: waiting
    for an unreachable database) ends the run instead of being forgotten."""
    caplog.set_level(logging.WARNING, logger="pgq.consumer")
    engine = pgq.connect("postgresql://postgres@127.0.0.1:1/none", schema=schema)
    consumer = pgq.Consumer(engine, "billing", lambda m: None, **FAST)
    result: list[pgq.RunSummary] = []
    runner = threading.Thread(target=lambda: result.append(consumer.run()))
    runner.start()
    wait_until(
        lambda: "database unavailable at start, retrying" in caplog.text,
        WAIT,
        "the member to retry the unreachable database",
    )
    assert runner.is_alive() and not result, result
    consumer.request_stop()
    runner.join(10)
    assert not runner.is_alive(), "the run went on after the stop"
    assert result[0].stop_reason == "signal"


def test_wait_retries_waits_for_retries_due_within_it(orders):
    """`run(until_empty=True, wait_retries=S)` also finishes retries that come due
    within S seconds; without it they are left for a later run."""
    engine = orders
    failed: set[int] = set()

    def handler(message: pgq.Message) -> None:
        if message.id not in failed:
            failed.add(message.id)
            raise pgq.RetryLater(0.5)

    pin_frontier(engine, "orders")  # waiting an hour: outside any window here
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    first = pgq.Consumer(engine, "billing", handler, **FAST).run(until_empty=True)
    assert (first.done, first.waiting_retry) == (0, 3 + 1)
    ids += pgq.publish_many(engine, "orders", [{"n": i} for i in range(3)])
    again = pgq.Consumer(engine, "billing", handler, **FAST)
    summary = again.run(until_empty=True, wait_retries=5.0)
    assert summary.stop_reason == "empty"
    assert (summary.done, summary.waiting_retry) == (6, 0 + 1)
    found = rows(engine, "billing")
    assert {state_of(found, mid) for mid in ids} == {"done"}


def test_wait_retries_is_bounded(orders):
    """A retry due after the window is left for a later run."""
    engine = orders

    def handler(message: pgq.Message) -> None:
        raise pgq.RetryLater(60)

    pgq.publish(engine, "orders", {"n": 1})
    started = time.monotonic()
    summary = pgq.Consumer(engine, "billing", handler, **FAST).run(
        until_empty=True, wait_retries=1.0
    )
    assert (summary.stop_reason, summary.waiting_retry) == ("empty", 1)
    assert time.monotonic() - started < 10


def test_wait_retries_must_be_a_sane_number(orders):
    consumer = pgq.Consumer(orders, "billing", lambda m: None, **FAST)
    for bad in (-1.0, float("inf"), float("nan"), 1e300):
        with pytest.raises(pgq.UsageError, match="wait_retries"):
            consumer.run(until_empty=True, wait_retries=bad)


def test_rows_a_release_could_not_hand_back_are_released_when_the_database_returns(
    orders, pg_dsn, schema, caplog
):
    """Defect 5: the local breaker trips while the database is away, so releasing the
    buffered rows fails. Those rows must not stay held (extended for the member's
    lifetime while nobody runs them): they go back once the database is back."""
    from chaos.proxy import Proxy

    engine = orders
    # one running and four buffered: the pool is full, nothing is left to claim
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(5)])
    failures: list[int] = []
    caplog.set_level(logging.WARNING, logger="pgq.consumer")

    def first_outcome_written() -> bool:
        return bool(rows(engine, "billing")[failures[0]].attempts == 1)

    with Proxy.for_dsn(pg_dsn) as proxy:
        through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)

        def handler(message: pgq.Message) -> None:
            failures.append(message.id)
            if len(failures) == 2:  # the trip comes with the database gone
                # all five rows are claimed (the fetcher idles: nothing is left to claim)
                # and the first failure's retry is written: the outage interrupts the
                # trip's release alone
                wait_until(first_outcome_written, WAIT, "the first failure's retry written")
                proxy.refuse()
                proxy.cut()
            raise pgq.SystemicError("dependency down")

        consumer = pgq.Consumer(
            through,
            "billing",
            handler,
            workers=1,
            prefetch=4,
            # longer than the outage: an expired lease would also come back, through a
            # sweep (a reclaim charged) that races the release once the database is back
            lease=12.0,
            breaker_window=2,
            breaker_min_calls=2,
            breaker_failure_rate=1.0,
            breaker_open_for=60.0,
            breaker_open_for_max=60.0,
            **{**FAST, "poll_interval": 4.0},
        )
        consumer.start()
        try:
            wait_until(lambda: len(failures) == 2, WAIT, "two systemic failures")
            wait_until(
                lambda: "could not release rows" in caplog.text,
                WAIT,
                "the fetcher's release of the buffered rows to fail",
            )
            proxy.allow()
            unstarted = set(ids) - set(failures)

            def released() -> bool:
                found = rows(engine, "billing")
                return all(found[mid].state == "ready" for mid in unstarted)

            wait_until(
                released,
                10,
                "the buffered rows to be released",
                describe=lambda: {m: r.state for m, r in rows(engine, "billing").items()},
            )
            found = rows(engine, "billing")
            assert all((found[m].attempts, found[m].reclaims) == (0, 0) for m in unstarted)
        finally:
            consumer.stop(timeout=5)
            through.dispose()


def _refuse_successes_of_listed_rows(engine: Engine, schema: str) -> None:
    """A trigger that makes the database refuse the ack of a row listed in `refuse`
    (as a user's trigger or a constraint might): deleting it or marking it done."""
    with engine.begin() as conn:
        conn.execute(text(f'CREATE TABLE "{schema}".refuse (message_id bigint)'))
        conn.execute(
            text(
                f'CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$'
                f' BEGIN IF EXISTS (SELECT FROM "{schema}".refuse r'
                " WHERE r.message_id = OLD.message_id)"
                " AND (TG_OP = 'DELETE' OR NEW.state = 'done')"
                " THEN RAISE EXCEPTION 'refused by the test'; END IF;"
                " IF TG_OP = 'DELETE' THEN RETURN OLD; END IF; RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                f'CREATE TRIGGER refuse BEFORE UPDATE OR DELETE ON "{schema}".delivery'
                f' FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse()'
            )
        )


@pytest.mark.parametrize("second", ["done", "refused"])
def test_a_second_signal_releases_buffered_rows_and_writes_finished_outcomes(
    orders, schema, second
):
    """Defect 12: `abort()` (the second signal) must not leave finished outcomes
    unwritten or buffered rows leased: it writes and releases what it can at once.
    It writes them as the acker does: a success the database refuses (here a
    trigger) is recorded as a failure that says why, and takes no other with it."""
    engine = orders
    if second == "refused":
        _refuse_successes_of_listed_rows(engine, schema)
    pin_frontier(engine, "orders")
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(12)])
    blocker = engine.connect()
    tx = blocker.begin()
    blocker_pid = blocker.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    first_running, first_locked, gate = threading.Event(), threading.Event(), threading.Event()
    handled: list[int] = []

    def handler(message: pgq.Message) -> None:
        handled.append(message.id)
        if len(handled) == 1:
            first_running.set()
            assert first_locked.wait(WAIT)  # its outcome's write will wait on the lock
        elif len(handled) <= 3:
            # finish after the acker took the first outcome alone: its write waits.
            # The ack opens with its `last` CTE (pg_stat_activity keeps the first kB
            # of a statement, track_activity_query_size: the ack's SET is past it)
            wait_until(
                lambda: waiting_on(engine, blocker_pid, "WITH last AS%"),
                WAIT,
                "the first outcome's write to wait on the test's lock",
            )
            if second == "refused" and len(handled) == 2:
                with engine.begin() as conn:
                    conn.execute(
                        text(f'INSERT INTO "{schema}".refuse VALUES (:id)'), {"id": message.id}
                    )
        else:
            assert gate.wait(WAIT)

    consumer = pgq.Consumer(engine, "billing", handler, workers=1, prefetch=4, **FAST)
    consumer.start()
    try:
        assert first_running.wait(WAIT)
        blocker.execute(
            text(f'SELECT 1 FROM "{schema}".delivery WHERE message_id = :id FOR UPDATE'),
            {"id": handled[0]},
        )
        first_locked.set()
        wait_until(lambda: len(handled) == 4, WAIT, "three outcomes and a running handler")
        leased = [mid for mid, r in rows(engine, "billing").items() if r.state == "leased"]
        buffered = [mid for mid in leased if mid not in handled]
        assert buffered
        consumer.abort()
        # what a process exiting right after the second signal leaves behind
        found = rows(engine, "billing")
        assert found[handled[0]].state == "leased"  # its write still waits on our lock
        written = handled[1:3] if second == "done" else handled[2:3]
        done = [mid for mid in handled[1:3] if state_of(found, mid) == "done"]
        assert done == written, {m: state_of(found, m) for m in handled}
        if second == "refused":
            refused = found[handled[1]]
            assert (refused.state, refused.error_class) == ("ready", "message")
            assert "pgq could not record the outcome" in refused.last_error
        assert all(found[mid].state == "ready" for mid in buffered)
    finally:
        gate.set()
        tx.rollback()
        blocker.close()
        consumer.stop(timeout=5)


def test_a_member_transaction_left_idle_gives_its_locks_back(orders, schema):
    """Defect 11's cause: a member paused (SIGSTOP) between two statements of a
    transaction held its row locks for as long as it was paused, so the other
    members' sweeps skipped those rows and `--until-empty` waited for ever. A
    member's own sessions end a transaction left idle (`lease`, at least 5 s)."""
    engine = orders
    mid = pgq.publish(engine, "orders", {"n": 1})
    member = pgq.store.member_links(engine, "g", "m", idle_in_transaction=1.0).work.engine
    lock = text(f'SELECT 1 FROM "{schema}".delivery WHERE message_id = :id FOR UPDATE')
    paused = member.connect()
    paused.begin()
    paused.execute(lock, {"id": mid})  # ... and the process is paused here
    try:
        with engine.connect() as other:

            def row_free() -> bool:
                with other.begin():
                    nowait = text(f"{lock.text} SKIP LOCKED")
                    return other.execute(nowait, {"id": mid}).first() is not None

            assert not row_free()
            wait_until(row_free, 10, "the idle transaction to end")
        with pytest.raises(pgq.DatabaseUnavailable), pgq.store.wrap_errors():
            paused.execute(text("SELECT 1"))
    finally:
        paused.invalidate()
        member.dispose()


class _Forwarding(Exception):
    """An error object forwarding attribute reads to its payload (as RPC client errors
    often do): reading a missing attribute, dunders included, raises KeyError."""

    def __init__(self, payload: dict[str, object]) -> None:
        super().__init__("upstream said no")
        self.payload = payload

    def __getattr__(self, name: str) -> object:
        return self.__dict__["payload"][name]


class _LazyRetry(pgq.RetryLater):
    """A snooze whose delay is whatever the server's Retry-After header said."""

    def __init__(self, header: object) -> None:
        self.header = header
        super().__init__(0, "throttled")

    @property  # type: ignore[override]
    def delay(self) -> object:
        return self.header

    @delay.setter
    def delay(self, value: object) -> None:
        pass


def test_exceptions_that_cannot_be_read_or_classified_fail_as_message(orders):
    """Found by attack (docs/defects.md): these crashed the worker, and with
    it the member, on every member that took the row."""
    engine = orders
    pin_frontier(engine, "orders")
    raised = {
        "forwarding": _Forwarding({"code": 17}),
        "header": _LazyRetry("120"),
        "bool": _LazyRetry(True),
    }
    ids = pgq.publish_many(engine, "orders", [{"kind": k} for k in raised] + [{"kind": "ok"}])

    def handler(message: pgq.Message) -> None:
        kind = message.payload["kind"]
        if kind != "ok":
            raise raised[kind]

    consumer = pgq.Consumer(engine, "billing", handler, workers=2, max_attempts=1, **FAST)
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    assert (summary.stop_reason, consumer.clean) == ("empty", True)
    found = rows(engine, "billing")
    assert found[ids[-1]].state == "done"
    for kind, mid in zip(raised, ids, strict=False):
        assert (found[mid].state, found[mid].error_class) == ("dead", "message"), kind
    assert "could not be classified" in found[ids[0]].last_error
    assert "'120'" in found[ids[1]].last_error


def test_a_stale_failure_in_the_same_batch_as_the_current_one_does_not_apply(orders, schema):
    """Found by the stateful model: the failure statement matched each outcome to its
    row by message id, so a stale outcome written in the same batch as the current
    lease's could be applied in its place."""
    from pgq.records import Outcome
    from pgq.store import GroupStore, group_info, run_once

    engine = orders
    pin_frontier(engine, "orders")
    mid = pgq.publish(engine, "orders", {"n": 1})
    info = group_info(engine, "billing")
    store = GroupStore(info.id, "billing", "orders", "m", 30.0, 3)
    [stale] = run_once(engine, store.claim, 1, 0)
    with engine.begin() as conn:  # its lease ended and was swept
        conn.execute(
            text(f"UPDATE \"{schema}\".delivery SET lease_expires_at = now() - interval '1s'")
        )
    assert run_once(engine, store.sweep).reclaimed == 1
    [current] = run_once(engine, store.claim, 1, 0)
    assert (stale.id, stale.seq != current.seq) == (current.id, True)
    outcomes = [
        Outcome(stale, "dead", error_class="permanent", error="stale"),
        Outcome(current, "retry", delay=0.0, error_class="message", error="current"),
    ]
    assert run_once(engine, store.record, outcomes) == {current.lease}
    row = rows(engine, "billing")[mid]
    assert (row.state, row.attempts, row.last_error) == ("ready", 1, "current")


def test_each_failure_of_a_batch_is_due_after_its_own_delay(orders):
    """The failure statement computes the times from its delays apart from the rows
    (decision 0023: Citus refuses `now()` with a column in the `SET`): each row
    still gets `now()` plus the delay written in the same place as its id."""
    from pgq.records import Outcome
    from pgq.store import GroupStore, group_info, run_once

    engine = orders
    pin_frontier(engine, "orders")
    pgq.publish_many(engine, "orders", [{"n": i} for i in range(4)])
    info = group_info(engine, "billing")
    store = GroupStore(info.id, "billing", "orders", "m", 30.0, 3)
    claimed = run_once(engine, store.claim, 4, 0)
    delays = dict(zip((c.id for c in claimed), (50.0, 0.0, 12.25, 3600.0), strict=True))
    outcomes = [
        Outcome(
            c,
            "snooze" if n % 2 else "retry",
            delay=delays[c.id],
            error_class=None if n % 2 else "message",
            error="x",
        )
        for n, c in enumerate(reversed(claimed))
    ]
    assert len(run_once(engine, store.record, outcomes)) == 4
    found = rows(engine, "billing")
    for mid, delay in delays.items():
        assert found[mid].available_at - found[mid].updated_at == dt.timedelta(seconds=delay)


def test_outcomes_written_before_a_cut_are_not_counted_refused(orders, pg_dsn, schema):
    """Every connection is cut again and again while a member writes outcomes of every
    kind: a statement that committed but whose answer the cut lost is retried, finds
    its leases settled, and must count them as applied, not "refused, lease lost"
    (before: hundreds of false refusals, `done` short by as many)."""
    from chaos.proxy import Proxy

    engine = orders
    n = 6_000
    for start in range(0, n, 2_000):
        pgq.publish_many(engine, "orders", [{"i": i} for i in range(start, start + 2_000)])
    lock = threading.Lock()
    calls: dict[int, int] = {}
    succeeded = 0

    def handler(msg: pgq.Message) -> None:
        nonlocal succeeded
        with lock:
            calls[msg.id] = calls.get(msg.id, 0) + 1
            first = calls[msg.id] == 1
            if msg.id % 3 == 0 or not first:
                succeeded += 1
                return
        if msg.id % 3 == 1:
            raise ValueError("fails once")
        raise pgq.RetryLater(0.01)

    with Proxy.for_dsn(pg_dsn) as proxy:
        through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
        consumer = pgq.Consumer(
            through,
            "billing",
            handler,
            prefetch="adaptive",
            lease=10.0,
            max_attempts=10,
            **{**FAST, "retry_backoff": 0.01, "retry_backoff_max": 0.01},
        )
        out: list[pgq.RunSummary] = []
        # retries come due 5-10 ms after their failure: a drain that found them not yet
        # due would leave them for a later run (counted in `waiting_retry`, by design)
        runner = threading.Thread(
            target=lambda: out.append(consumer.run(until_empty=True, wait_retries=WAIT))
        )
        runner.start()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.2)  # the faults under test: a cut every 0.2 s for 5 s
            proxy.cut()
        runner.join(120)
        through.dispose()
    assert out, "the until_empty run did not finish"
    (summary,) = out
    assert summary.refused == 0, summary
    assert summary.done == succeeded == n, (summary, succeeded)


FENCED = ("done", "retry", "release", "extend", "settled")


@pytest.mark.parametrize("statement", FENCED)
def test_the_fence_matches_each_id_with_its_own_token(orders, schema, statement):
    """A claim gives all its rows one token, so one token is current on several rows:
    a batch naming (X, stale) and (Y, current), where X's current token is Y's (both
    from one claim), applies to Y alone. A fence testing ids and tokens apart
    (`message_id = ANY(:ids) AND lease_seq = ANY(:seqs)`) would take X's newer lease
    for the stale one."""
    from pgq.records import Outcome
    from pgq.store import GroupStore, group_info, run_once

    engine = orders
    pin_frontier(engine, "orders")
    x, y = pgq.publish_many(engine, "orders", [{"n": 1}, {"n": 2}])
    store = GroupStore(group_info(engine, "billing").id, "billing", "orders", "m", 30.0, 3)
    first = {c.id: c for c in run_once(engine, store.claim, 2, 0)}
    released = [first[x].lease, first[y].lease]
    assert run_once(engine, store.release, released) == set(released)
    now = {c.id: c for c in run_once(engine, store.claim, 2, 0)}
    stale, x_now, y_now = first[x], now[x], now[y]
    assert x_now.seq == y_now.seq != stale.seq  # X's current token is Y's
    leases = [stale.lease, y_now.lease]

    if statement == "done":
        outcomes = [Outcome(stale, "done"), Outcome(y_now, "done")]
        assert run_once(engine, store.record, outcomes) == {y_now.lease}
    elif statement == "retry":
        outcomes = [
            Outcome(o, "retry", delay=0.0, error_class="message", error="x") for o in (stale, y_now)
        ]
        assert run_once(engine, store.record, outcomes) == {y_now.lease}
    elif statement == "release":
        assert run_once(engine, store.release, leases) == {y_now.lease}
    elif statement == "extend":
        with engine.begin() as conn:
            conn.execute(
                text(
                    f'UPDATE "{schema}".delivery SET lease_expires_at = now() + interval'
                    " '1 second'"
                )
            )
        assert run_once(engine, store.extend, leases) == {y_now.lease}
        later = rows(engine, "billing")
        assert later[x].lease_expires_at < later[y].lease_expires_at
    else:  # settled: both leases ended (X's by its holder), only Y's under its token
        # one outcome a batch: the ack keeps a batch's last row (marked done, with
        # its token), so both rows are there to be told apart by their tokens
        for lease in (x_now, y_now):
            assert run_once(engine, store.record, [Outcome(lease, "done")]) == {lease.lease}
        outcomes = [Outcome(stale, "done"), Outcome(y_now, "done")]
        assert run_once(engine, store.settled, outcomes) == {y_now.lease}
        return
    row = rows(engine, "billing")[x]
    assert (row.state, row.lease_seq, row.lease_owner, row.attempts) == (
        "leased",
        x_now.seq,
        "m",
        0,
    )
