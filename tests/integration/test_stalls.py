"""Every stall raises an alarm (issue 21, DESIGN §7).

Reported, each reproduced by a tester:

- `pgq check GROUP` said `OK ... lag 1` with no consumer running;
- a one-member group whose member's local breaker is open (the default
  `breaker.min_members = 2` keeps the group breaker CLOSED) showed CLOSED in
  `pgq status` and on the dashboard while nothing moved;
- the dashboard's "0/10 live" was not highlighted and counted members that
  had left cleanly.

`pgq check GROUP --max-age WARN[,CRIT]` (default `15m,1h`) is WARNING (CRITICAL)
when the oldest row ready now has been claimable longer than WARN (CRIT), and
says how many members are live; `status --json` has `oldest_ready_age_s`; the
views say `stalled:` and why when rows are ready now and nobody can take them.
Rows are aged by moving `available_at` back (the database clock), or, with a
real member, by short limits and bounded waits.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import pytest
from helpers import invoke
from sqlalchemy import Engine, func, insert, select, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.store.engine import schema_of

GROUP = "billing"


@pytest.fixture
def billing(orders: Engine) -> Engine:
    """The shared `orders` fixture (topic `orders`, group `billing`), named for the group."""
    return orders


def publish(engine: Engine, n: int) -> list[int]:
    return pgq.publish_many(engine, "orders", [{"n": i} for i in range(n)])


def age(engine: Engine, ids: list[int], seconds: float) -> None:
    """Make the rows `ids` claimable since `seconds` ago (a negative value: not yet)."""
    d = t.delivery
    with engine.begin() as conn:
        conn.execute(
            update(d)
            .where(d.c.message_id.in_(ids))
            .values(available_at=func.now() - dt.timedelta(seconds=seconds))
        )


def group_id(engine: Engine) -> int:
    g = t.consumer_group
    with engine.connect() as conn:
        return int(conn.scalar(select(g.c.id).where(g.c.name == GROUP)))


def add_member(engine: Engine, name: str, **values: Any) -> None:
    """A member row as a consumer writes it; `left_at` for one that left cleanly."""
    ago = func.now() - dt.timedelta(seconds=60)
    row = {
        "group_id": group_id(engine),
        "name": name,
        "host": "h",
        "pid": 1,
        "started_at": ago,
        "last_seen": ago,
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(t.member).values(**row))


# --- status: oldest_ready_age_s -------------------------------------------------------


def test_status_json_has_the_oldest_ready_age(billing, pgq_env):
    s = pgq.status(billing, GROUP)
    assert list(s)[-1] == "oldest_ready_age_s" and s["oldest_ready_age_s"] is None
    ids = publish(billing, 3)
    age(billing, ids[:1], 100)
    s = pgq.status(billing, GROUP)
    assert isinstance(s["oldest_ready_age_s"], float) and 100 <= s["oldest_ready_age_s"] < 160
    for args in (["status", GROUP, "--json"], ["status", "--json"]):
        result = invoke(pgq_env, *args)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        one = data if "group" in data else data["groups"][0]
        assert 100 <= one["oldest_ready_age_s"] < 160, args
    assert 100 <= monitor.read_status(billing, GROUP).oldest_ready_age_s < 160  # type: ignore[operator]


def test_every_group_has_its_own_oldest_ready_age(billing):
    pgq.subscribe(billing, "audit", "orders")
    ids = publish(billing, 2)
    gid = group_id(billing)
    d = t.delivery
    with billing.begin() as conn:
        conn.execute(
            update(d)
            .where(d.c.group_id == gid, d.c.message_id == ids[0])
            .values(available_at=func.now() - dt.timedelta(seconds=500))
        )
        conn.execute(update(d).where(d.c.group_id != gid).values(state="done"))
    ages = {g.group: g.oldest_ready_age_s for g in monitor.read_status_all(billing).groups}
    assert ages["audit"] is None
    assert ages[GROUP] is not None and 500 <= ages[GROUP] < 560


def test_the_oldest_ready_age_is_one_probe_of_the_ready_index(billing):
    """It runs in `status` for every group: one probe of `delivery_ready_idx` under a
    `LIMIT 1`, whatever the lag (here 3,000 ready rows, analyzed)."""
    from pgq.sql import status as q

    for _ in range(3):
        publish(billing, 1000)
    schema = schema_of(billing)
    with billing.connect() as conn:
        conn.exec_driver_sql(f'ANALYZE "{schema}".delivery')
        conn.commit()
        stmt = q.oldest_ready().compile(
            dialect=conn.dialect,
            schema_translate_map=billing.get_execution_options()["schema_translate_map"],
            render_schema_translate=True,
        )
        params = stmt.construct_params({"group_id": group_id(billing)})
        plan = [
            r[0] for r in conn.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF) " + str(stmt), params)
        ]
    text = "\n".join(plan)
    assert "Limit" in text and "Index Only Scan using delivery_ready_idx" in text, text
    assert "Seq Scan" not in text and "Sort" not in text, text
    scan = next(line for line in plan if "delivery_ready_idx" in line)
    assert re.search(r"actual time=\S+ rows=1(\.00)? loops=1", scan), text
