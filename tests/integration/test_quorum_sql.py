"""The quorum rule, checked against the statement that decides it in production.

One table of cases. Each case must give the same answer from the pure rule
(`pgq.breaker.trip_threshold` / `group_should_open`) and from the real SQL
(`GroupStore.open_on_quorum`, i.e. `pgq.sql.breaker.open_on_quorum`) run on a
fresh group whose `member` rows make up the case.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import Engine, func, insert, select, update

import pgq
from pgq import schema as t
from pgq.breaker import group_should_open, trip_threshold
from pgq.sql.members import take_session_lock
from pgq.store import GroupStore, group_info, schema_of


@dataclass(frozen=True)
class Case:
    id: str
    live: int
    quorum: float
    min_members: int
    needed: int
    """Tripped live members needed: max(min_members, ceil(quorum × live))."""
    tripped: int
    opens: bool


# fmt: off
CASES = [
    #     id                     live  quorum  min_members  needed  tripped  opens
    Case("0.1x30-at",              30,    0.1,           1,      3,       3,  True),
    Case("0.1x30-below",           30,    0.1,           1,      3,       2,  False),
    Case("0.1x30-all",             30,    0.1,           1,      3,      30,  True),
    # 0.14 × 50 is 7.000000000000001 in floats: the threshold must still be 7, not 8
    Case("0.14x50-at",             50,   0.14,           1,      7,       7,  True),
    Case("0.14x50-below",          50,   0.14,           1,      7,       6,  False),
    Case("0.3x10-at",              10,    0.3,           1,      3,       3,  True),
    Case("0.3x10-below",           10,    0.3,           1,      3,       2,  False),
    Case("0.5x3-at",                3,    0.5,           1,      2,       2,  True),
    Case("0.5x3-below",             3,    0.5,           1,      2,       1,  False),
    Case("0.5x4-at",                4,    0.5,           1,      2,       2,  True),
    Case("0.5x5-at",                5,    0.5,           1,      3,       3,  True),
    Case("0.5x5-below",             5,    0.5,           1,      3,       2,  False),
    Case("0.33x10-at",             10,   0.33,           1,      4,       4,  True),
    Case("0.33x10-below",          10,   0.33,           1,      4,       3,  False),
    Case("1.0x4-at",                4,    1.0,           1,      4,       4,  True),
    Case("1.0x4-below",             4,    1.0,           1,      4,       3,  False),
    Case("1.0x1-alone",             1,    1.0,           1,      1,       1,  True),
    # min_members above the quorum's count: min_members decides
    Case("min3-0.5x4-at",           4,    0.5,           3,      3,       3,  True),
    Case("min3-0.5x4-below",        4,    0.5,           3,      3,       2,  False),
    Case("min5-0.1x30-at",         30,    0.1,           5,      5,       5,  True),
    Case("min5-0.1x30-below",      30,    0.1,           5,      5,       4,  False),
    # the defaults (quorum 0.5, min_members 2): a lone member never opens the group
    Case("min2-0.5x1",              1,    0.5,           2,      2,       1,  False),
    Case("min3-more-than-live",     2,    0.5,           3,      3,       2,  False),
    # no tripped member never opens, even where the threshold is 0
    Case("none-tripped",            5,    0.5,           1,      3,       0,  False),
    Case("none-tripped-q0-min0",    5,    0.0,           0,      0,       0,  False),
    Case("one-tripped-q0-min0",     5,    0.0,           0,      0,       1,  True),
    Case("no-live-members",         0,    0.5,           1,      1,       0,  False),
]
# fmt: on

TTL = 30.0
"""Member TTL passed to the statement (seconds)."""
EPOCH = 2
"""The breaker's epoch when the case is decided (trips under older epochs must not count)."""
DECIDER = "decider"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_pure_rule(case: Case):
    assert trip_threshold(case.live, case.quorum, case.min_members) == case.needed
    assert group_should_open(case.tripped, case.live, case.quorum, case.min_members) is case.opens


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_production_statement(engine: Engine, case: Case):
    gid = fresh_group(engine)
    with members(engine, gid, live=case.live, tripped=case.tripped):
        with engine.begin() as conn:
            opened = decider(gid).open_on_quorum(
                conn, EPOCH, ttl=TTL, min_members=case.min_members, quorum=case.quorum
            )
    state, epoch, history = breaker_of(engine, gid)
    if case.opens:
        assert opened == EPOCH + 1
        assert (state, epoch) == ("OPEN", EPOCH + 1)
        assert history == [(EPOCH + 1, "OPEN", DECIDER)]
    else:
        assert opened is None
        assert (state, epoch) == ("CLOSED", EPOCH)
        assert history == []


def test_a_decision_at_an_epoch_the_group_left_does_nothing(engine: Engine):
    gid = fresh_group(engine)
    with members(engine, gid, live=3, tripped=3), engine.begin() as conn:
        opened = decider(gid).open_on_quorum(conn, EPOCH - 1, ttl=TTL, min_members=1, quorum=0.5)
    assert opened is None
    assert breaker_of(engine, gid) == ("CLOSED", EPOCH, [])


# -- the group and its members -----------------------------------------------------------


def fresh_group(engine: Engine) -> int:
    """Group `g` on topic `t`, its breaker CLOSED at `EPOCH`; its id."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    gid = group_info(engine, "g").id
    with engine.begin() as conn:
        conn.execute(update(t.breaker).where(t.breaker.c.group_id == gid).values(epoch=EPOCH))
    return gid


def decider(gid: int) -> GroupStore:
    """The store of the member that runs the statement (it is not one of the counted members)."""
    return GroupStore(gid, "g", "t", DECIDER, 30.0, 3)


@contextlib.contextmanager
def members(engine: Engine, gid: int, *, live: int, tripped: int) -> Iterator[None]:
    """While open: `live` live members of `gid`, `tripped` of them tripped at `EPOCH`.

    The one place that knows what makes a member live and tripped (as
    `pgq.sql.members.member_live` and `open_on_quorum` define them): live is
    a heartbeat (`last_seen`) within the TTL by the database clock, not left,
    and the member's session lock held by some session (here: one connection
    holds them all for the block); tripped is `local_breaker = 'open'` with
    `tripped_epoch` = the breaker's epoch.

    Members that must not count are added too: live ones whose local breaker
    tripped under an older epoch or is closed again (live, not tripped),
    tripped ones that stopped heartbeating or left (not live, even with their
    session there), and a tripped one with a fresh heartbeat whose session is
    gone (a process killed with `kill -9`).
    """
    now = func.now()
    stale = now - dt.timedelta(seconds=2 * TTL)
    rows = [
        member(gid, f"live-{i}", last_seen=now, tripped=i < tripped, old_trip=i % 2 == 1)
        for i in range(live)
    ]
    rows += [
        member(gid, "stale-1", last_seen=stale, tripped=True),
        member(gid, "stale-2", last_seen=stale, tripped=True),
        member(gid, "left", last_seen=now, tripped=True, left_at=now),
        member(gid, "killed", last_seen=now, tripped=True),
    ]
    with engine.begin() as conn:
        conn.execute(insert(t.member).values(rows))
    table = f'"{schema_of(engine)}".member'
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as sessions:
        for row in rows:
            if row["name"] != "killed":
                params = {"gid": gid, "member": row["name"], "table": table}
                assert sessions.execute(take_session_lock(), params).scalar()
        yield


def member(
    gid: int,
    name: str,
    *,
    last_seen: object,
    tripped: bool,
    old_trip: bool = False,
    left_at: object = None,
) -> dict[str, object]:
    """A `member` row; untripped members alternate between closed and tripped-long-ago."""
    if tripped:
        local, epoch = "open", EPOCH
    elif old_trip:
        local, epoch = "open", EPOCH - 1
    else:
        local, epoch = "closed", None
    return {
        "group_id": gid,
        "name": name,
        "host": "test",
        "pid": 1,
        "last_seen": last_seen,
        "local_breaker": local,
        "tripped_epoch": epoch,
        "left_at": left_at,
    }


def breaker_of(engine: Engine, gid: int) -> tuple[str, int, list[tuple[int, str, str | None]]]:
    """The breaker's state and epoch, and its history rows (epoch, state, by whom)."""
    br, h = t.breaker, t.breaker_history
    with engine.connect() as conn:
        state, epoch = conn.execute(
            select(br.c.state, br.c.epoch).where(br.c.group_id == gid)
        ).one()
        history = conn.execute(
            select(h.c.epoch, h.c.state, h.c.by_member)
            .where(h.c.group_id == gid)
            .order_by(h.c.epoch)
        ).all()
    return state, epoch, [tuple(r) for r in history]


def test_members_coming_and_going_between_the_reads_undo_the_open(engine: Engine, monkeypatch):
    """Liveness is read apart from the open statement (0023, 3.1). Here, between the
    read and the statement, a tripped member is killed (its session closes) and two
    healthy ones leave: before, 2 of 4 were tripped (3 needed at quorum 0.75), after,
    1 of 1 (2 needed). The statement alone, with the holders read before, counted
    the dead one live and the leavers gone: 2 of 2, OPEN, a quorum that never existed
    (docs/defects.md). The holders read again after
    the statement differ, so the open is undone; the transaction goes on."""
    import pgq.store.breaker as breaker_store

    gid = fresh_group(engine)
    table = f'"{schema_of(engine)}".member'
    now = func.now()
    rows = [
        member(gid, "tripped-a", last_seen=now, tripped=True),
        member(gid, "tripped-b", last_seen=now, tripped=True),
        member(gid, "healthy-1", last_seen=now, tripped=False),
        member(gid, "healthy-2", last_seen=now, tripped=False),
    ]
    with engine.begin() as conn:
        conn.execute(insert(t.member).values(rows))
    keep = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    doomed = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    for conn, name in [(keep, "tripped-a"), (doomed, "tripped-b")]:
        params = {"gid": gid, "member": name, "table": table}
        assert conn.execute(take_session_lock(), params).scalar()
    for name in ("healthy-1", "healthy-2"):
        params = {"gid": gid, "member": name, "table": table}
        assert keep.execute(take_session_lock(), params).scalar()
    read = breaker_store.lock_holders
    calls = []

    def between(conn, *args, **kwargs):
        held = read(conn, *args, **kwargs)
        calls.append(held)
        if len(calls) == 1:  # after the first read: the kill and the leaves
            doomed.close()
            keep.execute(
                update(t.member)
                .where(t.member.c.group_id == gid, t.member.c.name.like("healthy-%"))
                .values(left_at=func.now())
            )
        return held

    monkeypatch.setattr(breaker_store, "lock_holders", between)
    try:
        with engine.begin() as conn:
            opened = decider(gid).open_on_quorum(conn, EPOCH, ttl=TTL, min_members=2, quorum=0.75)
            assert conn.scalar(select(func.count()).select_from(t.member)) == 4  # goes on
    finally:
        keep.close()
    assert len(calls) == 2
    assert opened is None
    assert breaker_of(engine, gid) == ("CLOSED", EPOCH, [])
