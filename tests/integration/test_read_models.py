"""The typed read models print exactly the JSON the dicts printed (issue 20, DESIGN §7).

`pgq.monitor` built `status`, `status_all` and `members` as nested dicts; it now
builds the frozen models of `pgq.read_models` and the dicts are their
`to_json()`. The builders below are the old ones, kept verbatim as the oracle:
for one database state with every field filled (an OPEN breaker with a prober,
dead and pruned rows, totals, live and departed members, a frontier holder), the
public functions, `pgq status [GROUP] --json`, `pgq members --json` and the
dashboard's `/api/groups[/GROUP]` must give byte for byte (key order included)
what the old builders give for the same rows.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from helpers import invoke
from sqlalchemy import Engine, func, insert, select, text, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.read_models import GroupStatus, MemberStatus, StatusAll, iso, json_default
from pgq.records import BreakerState, LocalBreakerState
from pgq.store import inspect
from pgq.web.app import create_app
from pgq.web.guard import Guard
from pgq.web.views import Dashboard

TTL = monitor.DEFAULT_MEMBER_TTL
RECENT = monitor.RECENTLY_DEPARTED

# -- the old dict builders (pgq/monitor.py before issue 20), verbatim -------------------


def old_member(row: Any) -> dict[str, Any]:
    return {
        "name": row.name,
        "live": bool(row.live),
        "local_breaker": row.local_breaker,
        "last_seen": iso(row.last_seen),
        "host": row.host,
        "pid": row.pid,
        "started_at": iso(row.started_at),
        "left_at": iso(row.left_at),
    }


def old_breaker(row: Any, prober: str | None) -> dict[str, Any]:
    state = row.breaker_state
    return {
        "state": state,
        "since": iso(row.breaker_since),
        "prober": prober if state == BreakerState.OPEN else None,
        "epoch": int(row.breaker_epoch),
        "next_probe_at": iso(row.breaker_next_probe_at) if state == BreakerState.OPEN else None,
        "reconciling": row.breaker_reconcile_epoch is not None,
    }


def old_holder(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "pid": row.pid,
        "age_s": round(max(float(row.age_s or 0.0), 0.0), 3),
        "state": row.state,
        "datname": row.datname,
        "usename": row.usename,
        "application_name": row.application_name,
    }


OLD_ZERO_COUNTS: Mapping[str, int] = {
    "ready": 0,
    "leased": 0,
    "done": 0,
    "dead": 0,
    "dead_systemic": 0,
}


def old_group(rows: inspect.GroupRows) -> dict[str, Any]:
    row, counts = rows.row, rows.counts
    c = {k: int(v) for k, v in (counts or OLD_ZERO_COUNTS).items() if k in OLD_ZERO_COUNTS}
    done = c["done"] + int(row.done_pruned)
    return {
        "group": row.name,
        "topic": row.topic,
        "committed": row.committed_id,
        "counts": {
            "ready": c["ready"],
            "leased": c["leased"],
            "done": done,
            "dead": c["dead"],
            "dead_systemic": c["dead_systemic"],
        },
        "totals": {
            "reclaimed": int(row.reclaimed_total),
            "released": int(row.released_total),
            "refunded": int(row.refunded_total),
        },
        "lag": c["ready"] + c["leased"],
        "breaker": old_breaker(row, rows.prober),
        "members": [old_member(m) for m in rows.members],
        "frontier_held_by": old_holder(rows.holder),
        # issue 21 added one key, at the end
        "oldest_ready_age_s": (
            None if rows.oldest_ready_age_s is None else round(rows.oldest_ready_age_s, 3)
        ),
    }


def old_status(engine: Engine, group: str, departed: float | None = RECENT) -> dict[str, Any]:
    return old_group(inspect.group_status(engine, group, TTL, departed))


def old_status_all(engine: Engine, departed: float | None = RECENT) -> dict[str, Any]:
    return {"groups": [old_group(r) for r in inspect.all_group_status(engine, TTL, departed)]}


def old_members(engine: Engine, group: str, departed: float | None = RECENT) -> list[Any]:
    return [old_member(m) for m in inspect.member_rows(engine, group, TTL, departed)]


# -- one state with every field filled -------------------------------------------------


def group_id(engine: Engine, name: str) -> int:
    g = t.consumer_group
    with engine.connect() as conn:
        return int(conn.scalar(select(g.c.id).where(g.c.name == name)))


def add_member(engine: Engine, gid: int, name: str, **values: Any) -> None:
    now = func.now()
    row = {
        "group_id": gid,
        "name": name,
        "host": "h\x1bost",
        "pid": 4242,
        "started_at": now - dt.timedelta(seconds=120),
        "last_seen": now - dt.timedelta(seconds=1),
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(t.member).values(**row))


@pytest.fixture
def state(engine: Engine) -> Iterator[Engine]:
    """Two groups: `billing` with rows in every state, totals, an OPEN breaker owing a
    reconciliation, a live member with an open local breaker, a departed and a dead
    one; `audit` untouched. A second connection holds a transaction open."""
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    pgq.subscribe(engine, "audit", "orders")
    ids = pgq.publish_many(engine, "orders", [{"n": i} for i in range(8)])
    gid = group_id(engine, "billing")
    d, g, b = t.delivery, t.group_state, t.breaker
    with engine.begin() as conn:
        mine = d.c.group_id == gid
        conn.execute(update(d).where(mine & d.c.message_id.in_(ids[:2])).values(state="done"))
        conn.execute(update(d).where(mine & (d.c.message_id == ids[2])).values(state="leased"))
        conn.execute(
            update(d)
            .where((d.c.group_id == gid) & d.c.message_id.in_(ids[3:5]))
            .values(state="dead", error_class="systemic", last_error="down\nFORGED")
        )
        conn.execute(
            update(d)
            .where((d.c.group_id == gid) & (d.c.message_id == ids[5]))
            .values(state="dead", error_class="message", last_error="bad")
        )
        conn.execute(
            update(g)
            .where(g.c.group_id == gid)
            .values(
                committed_id=ids[1],
                done_pruned=7,
                reclaimed_total=3,
                released_total=11,
                refunded_total=2,
            )
        )
        conn.execute(
            update(b)
            .where(b.c.group_id == gid)
            .values(
                state="OPEN",
                epoch=5,
                since=func.now() - dt.timedelta(seconds=30),
                next_probe_at=func.now() + dt.timedelta(seconds=4),
                prober="stale-name",
                reconcile_epoch=4,
            )
        )
    add_member(engine, gid, "live-one", local_breaker=LocalBreakerState.OPEN.value)
    add_member(engine, gid, "left-one", left_at=func.now() - dt.timedelta(seconds=60))
    add_member(engine, gid, "gone-long-ago", last_seen=func.now() - dt.timedelta(hours=2))
    with engine.connect() as holder:
        holder.execute(text("SELECT txid_current()"))  # an xid: it holds the frontier
        yield engine
        holder.rollback()


HOLDER = re.compile(r'("frontier_held_by": ?)(\{[^{}]*\}|null)')
OLDEST = re.compile(r'("oldest_ready_age_s": ?)(null|[0-9.e+-]+)')


def steady(text: str) -> str:
    """`text` with the frontier holder object reduced to its keys in order: the oldest
    transaction in the cluster (other tests' too) and its age change between two
    reads. `test_the_holder_maps_as_before` pins its values. The oldest ready row's
    age grows between two reads too: only whether it is a number is kept."""

    def keys(match: re.Match[str]) -> str:
        holder = json.loads(match.group(2))
        return match.group(1) + json.dumps(None if holder is None else list(holder))

    def number(match: re.Match[str]) -> str:
        return match.group(1) + ("null" if match.group(2) == "null" else "0")

    return OLDEST.sub(number, HOLDER.sub(keys, text))


def dumped(value: Any) -> str:
    return steady(json.dumps(value, default=json_default))


# -- the pins ---------------------------------------------------------------------------


def test_the_state_fills_every_field(state):
    s = monitor.read_status(state, "billing")
    assert isinstance(s, GroupStatus) and s.breaker.state is BreakerState.OPEN
    assert s.breaker.reconciling and s.breaker.next_probe_at is not None
    assert s.counts.dead == 3 and s.counts.dead_systemic == 2 and s.counts.done == 9
    assert s.totals.released == 11 and s.committed is not None
    closed, opened = LocalBreakerState.CLOSED, LocalBreakerState.OPEN
    assert [m.local_breaker for m in s.members] == [closed, opened]
    assert all(isinstance(m, MemberStatus) for m in s.members)
    assert s.frontier_held_by is not None
    assert s.oldest_ready_age_s is not None and s.oldest_ready_age_s >= 0
    assert isinstance(monitor.read_status_all(state), StatusAll)


@pytest.mark.parametrize("departed", [RECENT, None])
def test_public_dicts_are_the_old_dicts_byte_for_byte(state, departed):
    assert dumped(monitor.status(state, "billing", departed_within=departed)) == dumped(
        old_status(state, "billing", departed)
    )
    assert dumped(monitor.status(state, "audit", departed_within=departed)) == dumped(
        old_status(state, "audit", departed)
    )
    assert dumped(monitor.status_all(state, departed_within=departed)) == dumped(
        old_status_all(state, departed)
    )
    assert dumped(monitor.members(state, "billing", departed_within=departed)) == dumped(
        old_members(state, "billing", departed)
    )
    holder, old = monitor.frontier_held_by(state), old_holder(inspect.frontier_holder(state))
    assert holder is not None and old is not None and list(holder) == list(old)


def test_the_holder_maps_as_before(state):
    row = inspect.frontier_holder(state)
    assert row is not None
    holder = monitor._holder(row)
    assert holder is not None
    assert json.dumps(holder.to_json()) == json.dumps(old_holder(row))


def test_public_dicts_hold_plain_strings_not_enums(state):
    s = monitor.status(state, "billing")
    assert type(s["breaker"]["state"]) is str
    assert {type(m["local_breaker"]) for m in s["members"]} == {str}


@pytest.mark.parametrize("every", [[], ["--all"]])
def test_cli_json_is_the_old_json_byte_for_byte(state, pgq_env, every):
    departed = None if every else RECENT
    for args, old in [
        (["status", "billing"], old_status(state, "billing", departed)),
        (["status"], old_status_all(state, departed)),
        (["members", "billing"], old_members(state, "billing", departed)),
    ]:
        result = invoke(pgq_env, *args, *every, "--json")
        assert result.exit_code == 0, result.output
        assert steady(result.output) == steady(json.dumps(old)) + "\n", args


def test_web_json_is_the_old_json_byte_for_byte(state):
    dashboard = Dashboard(state)
    try:
        app = create_app(dashboard, Guard(None), host="127.0.0.1", port=8080)
        client = app.test_client()
        with app.app_context():
            from flask import jsonify

            for path, old in [
                ("/api/groups", old_status_all(state)),
                ("/api/groups/billing", old_status(state, "billing")),
            ]:
                got = client.get(path, headers={"Host": "127.0.0.1:8080"})
                assert got.status_code == 200, got.data
                want = jsonify(old).get_data(as_text=True)
                assert steady(got.get_data(as_text=True)) == steady(want), path
    finally:
        dashboard.close()
