"""The status functions behind `pgq status`, `members`, `breaker` and `dead`."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from sqlalchemy import Engine, insert, update

import pgq
from pgq import monitor as st
from pgq import schema as t
from pgq.errors import UnknownGroup


@pytest.fixture
def billing(engine: Engine) -> Engine:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    return engine


def parse(ts: str) -> dt.datetime:
    assert ts.endswith("+00:00"), ts
    return dt.datetime.fromisoformat(ts)


def test_iso_is_utc_with_offset():
    cet = dt.timezone(dt.timedelta(hours=1))
    assert st.iso(dt.datetime(2026, 1, 1, 13, 0, tzinfo=cet)) == "2026-01-01T12:00:00+00:00"
    assert st.iso(None) is None


def test_status_of_a_fresh_group_after_publishing(billing):
    pgq.publish_many(billing, "orders", [{"n": i} for i in range(5)])
    s = st.status(billing, "billing")
    assert s["group"] == "billing" and s["topic"] == "orders"
    assert s["committed"] is None
    assert s["counts"] == {"ready": 5, "leased": 0, "done": 0, "dead": 0, "dead_systemic": 0}
    assert s["totals"] == {"reclaimed": 0, "released": 0, "refunded": 0}
    assert s["lag"] == 5
    b = s["breaker"]
    assert (b["state"], b["epoch"], b["prober"]) == ("CLOSED", 0, None)
    parse(b["since"])
    assert s["members"] == []
    assert st.dead(billing, "billing", 10) == []
    assert st.members(billing, "billing", 10.0) == []
    info = st.breaker_info(billing, "billing")
    assert (info["state"], info["epoch"], info["history"]) == ("CLOSED", 0, [])


def test_counts_states_totals_and_dead_rows(billing):
    ids = pgq.publish_many(billing, "orders", [{"n": i} for i in range(6)])
    d, g = t.delivery, t.consumer_group
    with billing.begin() as conn:
        gid = conn.scalar(g.select().with_only_columns(g.c.id).where(g.c.name == "billing"))
        conn.execute(update(d).where(d.c.message_id == ids[0]).values(state="done"))
        conn.execute(update(d).where(d.c.message_id == ids[1]).values(state="leased"))
        conn.execute(
            update(d)
            .where(d.c.message_id == ids[2])
            .values(state="dead", error_class="systemic", last_error="down", attempts=5)
        )
        conn.execute(
            update(d)
            .where(d.c.message_id == ids[3])
            .values(state="dead", error_class="permanent", last_error="bad")
        )
        # waiting for a retry still counts as ready
        conn.execute(
            update(d)
            .where(d.c.message_id == ids[4])
            .values(
                error_class="message", available_at=dt.datetime(2999, 1, 1, tzinfo=dt.timezone.utc)
            )
        )
        conn.execute(
            update(t.group_state)
            .where(t.group_state.c.group_id == gid)
            .values(done_pruned=10, reclaimed_total=1, released_total=2, refunded_total=3)
        )
    s = st.status(billing, "billing")
    assert s["counts"] == {"ready": 2, "leased": 1, "done": 11, "dead": 2, "dead_systemic": 1}
    assert s["totals"] == {"reclaimed": 1, "released": 2, "refunded": 3}
    assert s["lag"] == 3
    rows = st.dead(billing, "billing", 10)
    assert [r["message_id"] for r in rows] == [ids[2], ids[3]]
    assert set(rows[0]) >= {
        "message_id",
        "attempts",
        "reclaims",
        "refunds",
        "error_class",
        "error",
        "updated_at",
    }
    assert (rows[0]["error_class"], rows[0]["error"], rows[0]["attempts"]) == (
        "systemic",
        "down",
        5,
    )
    parse(rows[0]["updated_at"])
    assert len(st.dead(billing, "billing", 1)) == 1


def test_members_liveness_uses_the_database_clock_and_ttl(billing):
    gid = pgq.store.group_info(billing, "billing").id
    m = t.member
    with billing.begin() as conn:
        conn.execute(insert(m).values(group_id=gid, name="a", host="h", pid=1))
        conn.execute(
            insert(m).values(
                group_id=gid,
                name="b",
                host="h",
                pid=2,
                local_breaker="open",
                last_seen=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc),
            )
        )
        conn.execute(
            insert(m).values(
                group_id=gid, name="c", host="h", pid=3, left_at=dt.datetime.now(dt.timezone.utc)
            )
        )
        conn.execute(insert(m).values(group_id=gid, name="d", host="h", pid=4))
    # "a" runs: its session holds its lock; "d" heartbeat is fresh but its process
    # is gone (no session): killed members stop counting at once
    session = pgq.store.member_lock(billing, gid, "a")
    assert session.acquire()
    try:
        # "b" died in 2000: listed only when every member is asked for
        rows = st.members(billing, "billing", ttl=10.0, departed_within=None)
        assert [(r["name"], r["live"], r["local_breaker"]) for r in rows] == [
            ("a", True, "closed"),
            ("b", False, "open"),
            ("c", False, "closed"),
            ("d", False, "closed"),
        ]
        parse(rows[0]["last_seen"])
        every = st.status(billing, "billing", member_ttl=10.0, departed_within=None)
        assert every["members"] == rows
        assert [r["name"] for r in st.members(billing, "billing", ttl=10.0)] == ["a", "c", "d"]
    finally:
        session.release()
    assert not st.members(billing, "billing", ttl=10.0)[0]["live"]


def test_breaker_history_newest_first(billing):
    gid = pgq.store.group_info(billing, "billing").id
    h = t.breaker_history
    with billing.begin() as conn:
        conn.execute(insert(h).values(group_id=gid, epoch=0, state="OPEN"))
        conn.execute(insert(h).values(group_id=gid, epoch=1, state="CLOSED", refunded=7))
        conn.execute(
            update(t.breaker)
            .where(t.breaker.c.group_id == gid)
            .values(state="OPEN", epoch=1, prober="m1")
        )
    info = st.breaker_info(billing, "billing")
    # the prober comes from pg_locks (tests/integration/test_probes.py), not from the
    # stored name: no session holds m1's prober lock, so no prober is named
    assert (info["state"], info["epoch"], info["prober"]) == ("OPEN", 1, None)
    assert [(x["epoch"], x["state"], x["refunded"]) for x in info["history"]] == [
        (1, "CLOSED", 7),
        (0, "OPEN", 0),
    ]
    assert set(info["history"][0]) >= {"epoch", "state", "at", "refunded"}
    parse(info["history"][0]["at"])
    assert len(st.breaker_info(billing, "billing", history_limit=1)["history"]) == 1


def test_status_all_and_unknown_group(billing):
    pgq.subscribe(billing, "audit", "orders", start="latest")
    pgq.publish(billing, "orders", {"n": 1})
    groups = st.status_all(billing)["groups"]
    assert [g["group"] for g in groups] == ["audit", "billing"]
    assert all(g["counts"]["ready"] == 1 for g in groups)
    assert groups[1] == {
        **st.status(billing, "billing"),
        "frontier_held_by": groups[1]["frontier_held_by"],
        "oldest_ready_age_s": groups[1]["oldest_ready_age_s"],  # it grows between reads
    }
    for call in (st.status, st.members, st.breaker_info, st.dead):
        with pytest.raises(UnknownGroup):
            call(billing, "nope")


def test_frontier_held_by_an_open_transaction(billing, pg_dsn):
    """The holder is our open transaction, unless another session of the (shared)
    server has held an xid even longer."""
    with psycopg.connect(pg_dsn) as other, psycopg.connect(pg_dsn, autocommit=True) as probe:
        other.execute("SELECT pg_current_xact_id()")
        pid = other.info.backend_pid
        holder = st.frontier_held_by(billing)
        older = {
            backend
            for (backend,) in probe.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
                " AND age(backend_xid) >= (SELECT age(backend_xid) FROM pg_stat_activity"
                " WHERE pid = %s)",
                (pid,),
            )
        }
        assert holder is not None and holder["pid"] in older
        assert pid in older and holder["age_s"] >= 0
        assert st.status(billing, "billing")["frontier_held_by"] is not None
        other.rollback()
    after = st.frontier_held_by(billing)
    assert after is None or after["pid"] != pid
