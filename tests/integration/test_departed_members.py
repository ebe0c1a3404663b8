"""Departed members are forgotten, and listed only while recent (issue 11 #8).

Every `--until-empty` run joins under a new name and leaves a member row: a
cron entry every 5 minutes left 288 rows a day that `pgq status` and `pgq
members` listed for ever. A running member now deletes the group's members that
left or died longer than `breaker.member_retention` ago (never one whose
session still holds its lock, nor one whose name still holds a lease); the
commands list the live members and those that departed in the last 15 minutes,
and every member row with `--all`; human tables say times relative to now.
"""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
from helpers import FAST, invoke, wait_until
from sqlalchemy import Engine, func, insert, select, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.cli.render import ago, breaker_lines, breaker_word, members_lines, status_lines
from pgq.errors import ConfigError
from pgq.read_models import Counts, GroupBreaker, GroupStatus, MemberStatus, Totals
from pgq.records import BreakerState, LocalBreakerState
from pgq.settings import Settings, settings_from_kwargs
from pgq.store import member_lock
from pgq.store.members import forget_departed

HOUR = 3600.0
WAIT = 20.0
"""Bound on every wait for a consumer thread."""


@pytest.fixture
def gid(engine: Engine) -> int:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    with engine.connect() as conn:
        return int(conn.scalar(select(t.consumer_group.c.id).where(t.consumer_group.c.name == "g")))


def add_member(
    engine: Engine, gid: int, name: str, seen_ago: float, left_ago: float | None
) -> None:
    """A member row last heard from `seen_ago` seconds ago (by the database clock),
    that left `left_ago` seconds ago (None: it never left, it died)."""
    now = func.now()
    with engine.begin() as conn:
        conn.execute(
            insert(t.member).values(
                group_id=gid,
                name=name,
                host="h",
                pid=1,
                started_at=now - dt.timedelta(seconds=seen_ago + 60),
                last_seen=now - dt.timedelta(seconds=seen_ago),
                left_at=None if left_ago is None else now - dt.timedelta(seconds=left_ago),
            )
        )


def member_names(engine: Engine, gid: int) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(select(t.member.c.name).where(t.member.c.group_id == gid)))


def test_a_running_member_forgets_the_members_departed_longer_ago_than_the_setting(engine, gid):
    """Failed on 0e485ef: nothing ever deleted a member row."""
    add_member(engine, gid, "left-long-ago", 2 * HOUR, 2 * HOUR)
    add_member(engine, gid, "died-long-ago", 2 * HOUR, None)
    add_member(engine, gid, "left-recently", 60, 60)
    add_member(engine, gid, "holds-a-lease", 2 * HOUR, 2 * HOUR)
    add_member(engine, gid, "paused", 2 * HOUR, None)  # stopped, its session still there
    [mid] = pgq.publish_many(engine, "t", [{"n": 1}])
    with engine.begin() as conn:  # a lease the sweep leaves alone for an hour
        conn.execute(
            update(t.delivery)
            .where(t.delivery.c.message_id == mid)
            .values(
                state="leased",
                lease_owner="holds-a-lease",
                lease_seq=1,
                lease_expires_at=func.now() + dt.timedelta(hours=1),
            )
        )
    paused = member_lock(engine, gid, "paused")
    assert paused.acquire()
    consumer = pgq.Consumer(
        engine, "g", lambda m: None, name="runner", breaker_member_retention=600, **FAST
    )
    try:
        consumer.start()
        wait_until(
            lambda: not {"left-long-ago", "died-long-ago"} & member_names(engine, gid),
            WAIT,
            "the members departed 2 h ago forgotten",
            describe=lambda: member_names(engine, gid),
        )
        kept = {"left-recently", "holds-a-lease", "paused", "runner"}
        assert member_names(engine, gid) == kept
    finally:
        consumer.stop(timeout=10)
        paused.release()


def test_forgetting_never_touches_a_live_member(engine, gid):
    """Even with no retention at all: a live member's session holds its lock."""
    consumer = pgq.Consumer(engine, "g", lambda m: None, name="alive", **FAST)
    try:
        consumer.start()
        wait_until(
            lambda: (
                [m["live"] for m in monitor.members(engine, "g", FAST["breaker_member_ttl"])]
                == [True]
            ),
            WAIT,
            "the member live",
        )
        add_member(engine, gid, "gone", 5, 5)
        with engine.begin() as conn:
            assert forget_departed(conn, gid, 0.0) == ["gone"]
        assert member_names(engine, gid) == {"alive"}
    finally:
        consumer.stop(timeout=10)


@pytest.fixture
def departed(engine: Engine, gid: int) -> Engine:
    add_member(engine, gid, "left-2h", 2 * HOUR, 2 * HOUR)
    add_member(engine, gid, "died-3d", 3 * 86400, None)
    add_member(engine, gid, "left-1min", 70, 61)
    return engine


def test_status_and_members_list_recent_members_and_every_one_with_all(departed, pgq_env):
    """Failed on 0e485ef: every member row was listed, however long ago it departed."""

    def names(*args: str) -> list[str]:
        result = invoke(pgq_env, *args, "--json")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        if args[0] == "members":
            return [m["name"] for m in data]
        group = data if "g" in args else data["groups"][0]
        return [m["name"] for m in group["members"]]

    for args in (("members", "g"), ("status", "g"), ("status",)):
        assert names(*args) == ["left-1min"], args
        assert names(*args, "--all") == ["died-3d", "left-1min", "left-2h"], args
    assert [m["name"] for m in pgq.status(departed, "g")["members"]] == ["left-1min"]
    every = pgq.status(departed, "g", departed_within=None)["members"]
    assert [m["name"] for m in every] == ["died-3d", "left-1min", "left-2h"]


def test_human_tables_say_how_long_ago(departed, pgq_env):
    """Failed on 0e485ef: absolute timestamps only."""
    out = invoke(pgq_env, "members", "g", "--all").output
    row = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert row["left-2h"].split()[1:] == ["no", "closed", "2", "h", "ago", "2", "h", "ago"]
    assert row["died-3d"].split()[1:] == ["no", "closed", "3", "d", "ago", "-"]
    assert row["left-1min"].split()[1:] == ["no", "closed", *["1", "min", "ago"] * 2]
    status = invoke(pgq_env, "status", "g").output
    assert re.search(r"breaker    CLOSED since \d+ s ago \(\d{4}-", status), status


# -- the renderers, with a fixed now ------------------------------------------------

NOW = dt.datetime(2026, 11, 29, 20, 0, 0, tzinfo=dt.timezone.utc)


def when(seconds_ago: float) -> dt.datetime:
    return NOW - dt.timedelta(seconds=seconds_ago)


def at(seconds_ago: float) -> str:
    return when(seconds_ago).isoformat()


@pytest.mark.parametrize(
    ("seconds_ago", "text"),
    [
        (0, "0 s ago"),
        (3.9, "3 s ago"),
        (59, "59 s ago"),
        (60, "1 min ago"),
        (3599, "59 min ago"),
        (2 * HOUR + 59, "2 h ago"),
        (86400 * 3 + 5, "3 d ago"),
        (-4, "in 4 s"),
        (-90, "in 1 min"),
    ],
)
def test_ago(seconds_ago, text):
    assert ago(at(seconds_ago), NOW) == text


def test_ago_of_nothing_is_nothing():
    assert ago(None, NOW) is None


def test_ago_of_a_datetime_is_ago_of_its_iso_text():
    assert ago(when(90), NOW) == ago(at(90), NOW) == "1 min ago"


def member(name: str, *, live: bool, local: str, seen: float, left: float | None) -> MemberStatus:
    return MemberStatus(
        name=name,
        live=live,
        local_breaker=LocalBreakerState(local),
        last_seen=when(seen),
        host="h",
        pid=1,
        started_at=when(seen),
        left_at=None if left is None else when(left),
    )


def test_members_table_with_times_relative_to_now_and_open_breakers_standing_out():
    lines = members_lines(
        [
            member("a", live=True, local="closed", seen=1.5, left=None),
            member("b", live=True, local="open", seen=3, left=None),
            member("c", live=False, local="closed", seen=7300, left=7200),
        ],
        now=NOW,
    )
    assert lines == [
        "NAME  LIVE  LOCAL_BREAKER  LAST_SEEN  LEFT",
        "a     yes   closed         1 s ago    -",
        "b     yes   OPEN !         3 s ago    -",
        "c     no    closed         2 h ago    2 h ago",
    ]


def test_an_open_group_breaker_stands_out():
    assert breaker_word("OPEN") == breaker_word("open") == "OPEN !"
    assert breaker_word("CLOSED") == "CLOSED" and breaker_word("closed") == "closed"
    info = {
        "state": "OPEN",
        "since": at(42),
        "epoch": 3,
        "prober": "p",
        "next_probe_at": at(-5),
        "history": [{"epoch": 3, "state": "OPEN", "at": at(42), "refunded": 0}],
    }
    lines = breaker_lines(info, now=NOW)
    assert lines[:2] == ["state   OPEN !", f"since   42 s ago ({at(42)})"]
    assert f"next probe  in 5 s ({at(-5)})" in lines
    assert lines[-1].split() == ["3", "OPEN", "!", "42", "s", "ago", "0"]
    status = GroupStatus(
        group="g",
        topic="t",
        committed=None,
        counts=Counts(ready=0, leased=0, done=0, dead=0, dead_systemic=0),
        totals=Totals(reclaimed=0, released=0, refunded=0),
        lag=0,
        breaker=GroupBreaker(
            state=BreakerState.OPEN,
            since=when(42),
            prober="p",
            epoch=3,
            next_probe_at=when(-5),
            reconciling=False,
        ),
        members=(member("a", live=True, local="open", seen=2, left=None),),
        frontier_held_by=None,
    )
    lines = status_lines(status, now=NOW)
    assert f"  breaker    OPEN ! since 42 s ago ({at(42)}), epoch 3, prober p" in lines
    assert lines[-1] == "    a     yes   OPEN !         2 s ago    -"


# -- the setting ----------------------------------------------------------------------


def test_member_retention_defaults_to_a_day_and_is_at_least_member_ttl():
    assert Settings().breaker_member_retention == 86400.0
    assert settings_from_kwargs(breaker_member_retention="2h").breaker_member_retention == 7200
    with pytest.raises(
        ConfigError, match=r"breaker_member_retention .*must be >= breaker_member_ttl"
    ):
        settings_from_kwargs(breaker_member_retention=5)


def test_liveness_tests_the_locks_of_the_members_that_can_be_live_in_one_pass(engine, gid):
    """The lock test reads `pg_locks` once for all names (a hashed subplan), and the
    liveness reads give it only the members heard from within the TTL: before, every
    member row of the group, departed ones included, was tested one by one, and a
    group with 22,000 departed rows spent 0.3 s per drain check and quorum read
    (docs/defects.md)."""
    from pgq.sql import members as member_sql
    from pgq.store.members import lock_holders

    old = func.now() - dt.timedelta(hours=2)
    gone = [
        {"group_id": gid, "name": f"gone-{i}", "host": "h", "pid": 1, "last_seen": old}
        for i in range(2000)
    ]
    with engine.begin() as conn:
        conn.execute(insert(t.member).values(gone))
    add_member(engine, gid, "live", seen_ago=0, left_ago=None)
    session = member_lock(engine, gid, "live")
    assert session.acquire()
    try:
        with engine.connect() as conn:
            ttl = {"gid": gid, "ttl": dt.timedelta(seconds=30)}
            fresh = conn.execute(member_sql.member_names(False, "fresh"), ttl)
            assert [r.name for r in fresh] == ["live"]
            holders = lock_holders(conn, gid, "", ttl=30.0)
            assert holders["present_names"] == ["live"]
            assert lock_holders(conn, gid, "", after=HOUR)["present_names"] == []
            stmt = member_sql.holding("").compile(
                dialect=conn.dialect,
                schema_translate_map=engine.get_execution_options()["schema_translate_map"],
                render_schema_translate=True,
            )
            params = stmt.construct_params(
                {"gids": [gid] * 3, "names": ["a", "b", "c"], "table": holders["table"]}
            )
            plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(stmt), params))
    finally:
        session.release()
    assert "hashed SubPlan" in plan, plan
    assert plan.count("pg_lock_status") == 1, plan
