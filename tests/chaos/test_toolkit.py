"""Self-tests of the chaos toolkit: the proxy really forwards, cuts, stalls and
refuses; the history checker passes a clean drain and catches a lost message,
an unexplained duplicate, an orphan row and a stale lease when we fake one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from helpers import FAST, pin_frontier, wait_until
from sqlalchemy import Connection, Engine, text

import pgq

from . import history
from .drivers import Drivers, Published, Record, Subscription, message_ids, retention_pass
from .handlers import AttemptLog
from .procs import ProcEvent
from .proxy import Proxy

# -- the proxy ----------------------------------------------------------------------------


def backend_alive(pg_dsn: str, pid: int) -> bool:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        return row is not None


def test_the_proxy_forwards_and_counts(proxy: Proxy, pg_dsn: str) -> None:
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as conn:
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
        assert proxy.open_connections == 1
        big = conn.execute("SELECT repeat('x', 1000000)").fetchone()
        assert big is not None and len(big[0]) == 1_000_000
    wait_until(lambda: proxy.open_connections == 0, 5, "the closed connection to leave")
    assert proxy.accepted == 1


def test_the_proxy_carries_notifications(proxy: Proxy, pg_dsn: str) -> None:
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as listener:
        listener.execute("LISTEN chaos_test")
        with psycopg.connect(pg_dsn, autocommit=True) as direct:
            direct.execute("NOTIFY chaos_test, 'hello'")
        got = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert got == ["hello"]


@pytest.mark.parametrize("how", ["rst", "close"])
def test_a_cut_is_an_error_on_both_ends(proxy: Proxy, pg_dsn: str, how: str) -> None:
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        assert proxy.cut(how) == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    assert proxy.open_connections == 0
    # the server saw it too: the backend (and its session locks) is gone
    wait_until(lambda: not backend_alive(pg_dsn, pid), 5, "the backend to end")
    # new connections work after a cut
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert [f.kind for f in proxy.faults] == ["cut"]


def test_a_timed_stall_delays_a_query_that_then_completes(proxy: Proxy, pg_dsn: str) -> None:
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as conn:
        proxy.stall(0.6)
        started = time.monotonic()
        assert conn.execute("SELECT 7").fetchone() == (7,)
        assert time.monotonic() - started >= 0.5
        assert not proxy.stalled


def test_a_stall_holds_until_resumed(proxy: Proxy, pg_dsn: str) -> None:
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as conn:
        proxy.stall()
        result: list[object] = []
        worker = threading.Thread(target=lambda: result.append(conn.execute("SELECT 8").fetchone()))
        worker.start()
        time.sleep(0.4)
        assert result == [] and worker.is_alive()  # still waiting
        proxy.resume()
        worker.join(5)
        assert result == [(8,)]
    [fault] = proxy.faults
    assert fault.kind == "stall" and fault.end is not None and fault.end - fault.start >= 0.4


def test_refused_connections_fail_until_allowed(proxy: Proxy, pg_dsn: str) -> None:
    proxy.refuse()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(proxy.dsn(pg_dsn), connect_timeout=5).close()
    assert proxy.refused == 1
    proxy.allow()
    with psycopg.connect(proxy.dsn(pg_dsn), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_closing_the_proxy_ends_its_threads_and_connections(pg_dsn: str) -> None:
    proxy = Proxy.for_dsn(pg_dsn)
    conn = psycopg.connect(proxy.dsn(pg_dsn), autocommit=True)
    try:
        proxy.stall()  # even a stalled connection
        proxy.close()
        assert proxy.threads_alive() == 0
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    finally:
        conn.close()


def test_a_member_runs_every_connection_through_the_proxy(
    proxy: Proxy, pg_dsn: str, schema: str, engine: Engine, out: Path
) -> None:
    """Pooled roles and the LISTEN connection of an in-process member all use the proxy."""
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    through = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
    handler = AttemptLog(out, "m1", sleep=0)
    try:
        with pgq.Consumer(through, "billing", handler, workers=2, name="m1", **FAST):
            proxy.wait_connections(3)  # at least fetcher/acker/heartbeat and LISTEN
            cut = proxy.cut()
            ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(5)])
            wait_until(
                lambda: set(ids) <= {a.id for a in history.read_attempts(out)[0]},
                20,
                "the member to handle messages after the cut",
            )
        assert cut >= 3
    finally:
        handler.close()
        through.dispose()


# -- the history checker ----------------------------------------------------------------------


def drain(
    engine: Engine, group: str, out: Path, member: str = "m1", **settings: object
) -> pgq.RunSummary:
    handler = AttemptLog(out, member, sleep=0)
    try:
        consumer = pgq.Consumer(
            engine, group, handler, workers=2, name=member, **{**FAST, **settings}
        )
        return consumer.run(until_empty=True, max_runtime=30)
    finally:
        handler.close()


def drain_and_prune(engine: Engine, group: str, out: Path, member: str = "m1") -> None:
    """Handle everything and keep the member running until its maintenance has
    pruned every done row (the frontier waits for the server's xmin, which other
    sessions on a shared server can hold back for a while)."""
    handler = AttemptLog(out, member, sleep=0)
    try:
        with pgq.Consumer(engine, group, handler, workers=2, name=member, **FAST):
            wait_until(
                lambda: not history._rows(engine, "orders").get(group),
                60,
                "the done rows to be pruned",
                interval=0.1,
            )
    finally:
        handler.close()


@pytest.fixture
def drained(engine: Engine, out: Path) -> tuple[Engine, list[int]]:
    """20 messages of `orders` handled by group `billing`; the frontier pinned and
    acks of one (each keeps its row, marked done), so the done rows stay readable."""
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    pin_frontier(engine, "orders")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(20)])
    assert drain(engine, "billing", out, batch_size=1).done == 20
    return engine, ids


def check(engine: Engine, out: Path, ids: list[int], **kw: object) -> history.Summary:
    return history.check(engine, "orders", out, published=ids, settled=False, **kw)  # type: ignore[arg-type]


def test_a_clean_drain_passes(
    drained: tuple[Engine, list[int]], out: Path, pgq_env: dict[str, str]
) -> None:
    engine, ids = drained
    summary = check(engine, out, ids, cli_env=pgq_env)  # the real `pgq status --json`
    print(summary)
    summary.assert_ok()
    assert (summary.published, summary.handled, summary.distinct) == (20, 20, 20)
    assert summary.lost == [] and sum(summary.duplicates.values()) == 0
    assert summary.groups["billing"].done == 20


def test_a_clean_drain_after_pruning_and_retention_passes(engine: Engine, out: Path) -> None:
    """Done rows pruned behind the frontier and messages deleted by retention still
    count as done: the checker finds them in the handler logs."""
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(20)])
    drain_and_prune(engine, "billing", out)
    assert sorted(retention_pass(engine, "orders")) == ids
    summary = history.check(engine, "orders", out, published=ids)
    print(summary)
    summary.assert_ok()
    assert summary.groups["billing"].done == 20


def test_a_late_group_is_excused_only_from_what_retention_deleted_before_it(
    engine: Engine, out: Path, schema: str
) -> None:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    record = Record()

    def publish(n: int) -> list[int]:
        began = time.time()
        ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(n)])
        for mid in ids:
            record.add(Published(mid, "orders", "t", began, time.time(), False))
        return ids

    old = publish(10)
    drain_and_prune(engine, "billing", out)
    kept = old[-1]  # this one survives retention: the late group must get it
    with engine.begin() as conn:
        conn.execute(
            text(f'DELETE FROM "{schema}".message WHERE id = ANY(:ids)'), {"ids": old[:-1]}
        )
    began = time.time()
    pgq.subscribe(engine, "late0", "orders", start="earliest")
    record.add(
        Subscription(
            "late0", "orders", began, time.time(), frozenset(message_ids(engine, "orders"))
        )
    )
    new = publish(5)
    drain(engine, "billing", out)
    drain(engine, "late0", out, member="m2")
    summary = history.check(engine, "orders", out, record=record)
    print(summary)
    summary.assert_ok()
    late = summary.groups["late0"]
    assert (late.expected, late.excused, late.done) == (6, 9, 6)
    assert sorted(history.read_ids(out, "late0")) == [kept, *new]
    # a message the late group should have had, and did not, is lost
    with engine.begin() as conn:
        conn.execute(
            text(
                f'DELETE FROM "{schema}".delivery WHERE message_id = :id AND group_id ='
                f" (SELECT id FROM \"{schema}\".consumer_group WHERE name = 'late0')"
            ),
            {"id": kept},
        )
    for path in out.glob("attempts-m2-*"):  # and it was never handled
        lines = path.read_text().splitlines()
        path.write_text("".join(f"{ln}\n" for ln in lines if f" {kept} " not in ln))
    lost = history.check(engine, "orders", out, record=record, settled=False)
    [item] = lost.lost
    assert item.startswith(f"late0 {kept}: no delivery row and never handled"), lost


def test_a_lost_message_fails_the_check(engine: Engine, out: Path, schema: str) -> None:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    pin_frontier(engine, "orders")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(10)])
    with engine.begin() as conn:  # the group never gets ids[3]: its row vanishes
        conn.execute(
            text(f'DELETE FROM "{schema}".delivery WHERE message_id = :id'),
            {"id": ids[3]},
        )
    drain(engine, "billing", out)
    summary = check(engine, out, ids)
    print(summary)
    assert not summary.ok
    assert summary.lost == [f"billing {ids[3]}: no delivery row and never handled"]


def test_a_stuck_row_is_lost_and_a_stale_lease(
    drained: tuple[Engine, list[int]], out: Path, schema: str
) -> None:
    engine, ids = drained
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE \"{schema}\".delivery SET state = 'leased',"
                " lease_owner = 'ghost', lease_expires_at = now() - interval '5 seconds'"
                " WHERE message_id = :id"
            ),
            {"id": ids[0]},
        )
    summary = check(engine, out, ids)
    print(summary)
    assert not summary.ok
    assert summary.lost and summary.lost[0].startswith(f"billing {ids[0]}: still leased by ghost")
    assert len(summary.stale_leases) == 1 and "ghost" in summary.stale_leases[0]


def fake_second_handling(
    out: Path, mid: int, member: str = "m2", start: float | None = None, end: float | None = None
) -> None:
    """Log another successful handling of `mid` by `member` (default: 1 s from now)."""
    start = time.time() + 1 if start is None else start
    end = start + 0.01 if end is None else end
    log = AttemptLog(out, member, sleep=0)
    with log.path.open("a") as f:
        f.write(f"{start:.6f} 999999 {member} billing {mid} 1 start\n")
        f.write(f"{end:.6f} 999999 {member} billing {mid} 1 ok\n")


def test_an_unexplained_duplicate_fails_the_check(
    drained: tuple[Engine, list[int]], out: Path
) -> None:
    engine, ids = drained
    fake_second_handling(out, ids[5])
    summary = check(engine, out, ids)
    print(summary)
    assert not summary.ok
    assert len(summary.unexplained) == 1 and summary.unexplained[0].startswith(f"billing {ids[5]}")
    # and more duplicates than the group's reclaims is a problem of its own
    assert any("only 0 reclaims" in p for p in summary.problems)


def test_a_duplicate_after_a_kill_or_a_reclaim_is_explained(
    drained: tuple[Engine, list[int]], out: Path, schema: str
) -> None:
    engine, ids = drained
    [first] = [a for a in history.read_attempts(out)[0] if a.id == ids[5] and a.event == "ok"]
    fake_second_handling(out, ids[5])
    killed = ProcEvent("m1", "kill9", first.at + 0.05, 1)
    faults = history.fault_windows([killed])
    summary = check(engine, out, ids, faults=faults)
    assert summary.unexplained == [] and summary.duplicates == {"kill9 of m1": 1}, summary
    # a kill of a member that never handled it explains nothing
    other = history.fault_windows([ProcEvent("m9", "kill9", first.at + 0.05, 1)])
    assert len(check(engine, out, ids, faults=other).unexplained) == 1
    # a pause shorter than the lease explains nothing; one past it does
    short = [ProcEvent("m1", "stop", first.at, 1), ProcEvent("m1", "cont", first.at + 0.5, 1)]
    assert len(check(engine, out, ids, faults=history.fault_windows(short, lease=2)).unexplained)
    long = [ProcEvent("m1", "stop", first.at, 1), ProcEvent("m1", "cont", first.at + 2.5, 1)]
    explained = check(engine, out, ids, faults=history.fault_windows(long, lease=2))
    assert explained.duplicates == {"pause of m1": 1}
    # a member paused mid-handler that finishes after the reclaimer: its own pause explains it
    fake_second_handling(out, ids[6], "m3", start=first.at - 0.5, end=first.at + 3)
    paused = [
        ProcEvent("m3", "stop", first.at - 0.4, 1),
        ProcEvent("m3", "cont", first.at + 2.9, 1),
    ]
    both = check(engine, out, ids, faults=history.fault_windows([killed, *paused], lease=2))
    assert both.duplicates == {"kill9 of m1": 1, "pause of m3": 1}, both
    assert len(check(engine, out, ids, faults=history.fault_windows([killed])).unexplained) == 1
    # the row's own reclaim count explains it too
    with engine.begin() as conn:
        conn.execute(
            text(f'UPDATE "{schema}".delivery SET reclaims = 1 WHERE message_id = :id'),
            {"id": ids[5]},
        )
    assert check(engine, out, ids).duplicates == {"reclaim": 1}


def test_an_orphan_row_fails_the_check(
    drained: tuple[Engine, list[int]], out: Path, schema: str
) -> None:
    engine, ids = drained
    with engine.begin() as conn:
        conn.execute(
            text(
                f'INSERT INTO "{schema}".delivery (group_id, message_id, xid, state)'
                " SELECT id, 999999999, pg_current_xact_id(), 'done'"
                f' FROM "{schema}".consumer_group'
            )
        )
    summary = check(engine, out, ids)
    assert not summary.ok and summary.orphans == ["billing 999999999 done"], summary


def test_the_drivers_publish_subscribe_and_retain_concurrently(engine: Engine) -> None:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    with Drivers(engine, "orders", seconds=2.0) as drivers:
        drivers.publish(threads=3, tx_threads=1, count=200, interval=0.01)
        drivers.subscribe(count=2, interval=0.5)
        drivers.retain(interval=0.3)
        record = drivers.wait(timeout=20)
    print(record.describe())
    assert len(record.ids("orders")) == len(set(record.ids("orders"))) > 30
    assert record.out_of_order_commits() > 0
    assert [s.group for s in record.subscriptions] == ["late0", "late1"]
    assert len(record.retention) >= 2
    assert set(record.ids("orders")) <= message_ids(engine, "orders")  # nobody consumed
    assert any(record.groups_before(p) for p in record.published)


@pytest.mark.parametrize("found", ["each_once", "a_duplicate", "one_missing", "a_stray"])
def test_a_transactional_groups_effects_are_each_once(
    engine: Engine, out: Path, schema: str, found: str
) -> None:
    """A transactional group's effect rows are its history: one per message it must
    have, or the check fails, even for a duplicate a kill would explain."""
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    table = history.create_effects(engine, schema, "billing")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(10)])

    def handler(message: pgq.Message, conn: Connection) -> None:
        conn.execute(
            text(f"INSERT INTO {table} (message_id, attempt, member) VALUES (:id, :n, 'm1')"),
            {"id": message.id, "n": message.attempt},
        )

    consumer = pgq.Consumer(engine, "billing", handler, transactional=True, workers=2, **FAST)
    assert consumer.run(until_empty=True, max_runtime=30).done == 10
    with engine.begin() as conn:
        if found == "a_duplicate":
            conn.execute(text(f"INSERT INTO {table} VALUES ({ids[4]}, 1, 'm2')"))
        elif found == "one_missing":
            conn.execute(text(f"DELETE FROM {table} WHERE message_id = {ids[4]}"))
        elif found == "a_stray":
            conn.execute(text(f"INSERT INTO {table} VALUES ({ids[-1] + 100}, 1, 'm2')"))
    kill = history.FaultWindow("kill9", "m1", time.time() - 60, time.time())
    summary = check(engine, out, ids, effects={"billing": table}, faults=[kill])
    print(summary)
    effects = summary.effects["billing"]
    if found == "each_once":
        summary.assert_ok()
        assert (effects.messages, effects.effects) == (10, 10)
        return
    assert not summary.ok
    assert (effects.duplicates, effects.missing, effects.unexpected) == {
        "a_duplicate": (1, 0, 0),
        "one_missing": (0, 1, 0),
        "a_stray": (0, 0, 1),
    }[found]
