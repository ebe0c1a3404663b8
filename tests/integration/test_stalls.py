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
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import FAST, PGQ, invoke, kill, wait_until
from sqlalchemy import Engine, func, insert, select, update

import pgq
from pgq import monitor
from pgq import schema as t
from pgq.cli.parse import parse_max_age
from pgq.errors import UsageError
from pgq.store.engine import schema_of
from pgq.web.app import create_app
from pgq.web.guard import Guard
from pgq.web.views import Dashboard

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


# --- pgq check: a stall is a state --------------------------------------------------


def test_no_consumer_running_is_a_warning_then_critical(billing, pgq_env):
    """Before: `OK: breaker CLOSED (epoch 0), lag 1, ...` however long the row waited."""
    ids = publish(billing, 1)
    age(billing, ids, 20 * 60)
    result = invoke(pgq_env, "check", GROUP)
    assert (result.exit_code, result.stdout) == (
        1,
        "WARNING: oldest ready row claimable for 20 min (over 15 min), no live member\n",
    ), result.output
    age(billing, ids, 2 * 3600 + 5)
    result = invoke(pgq_env, "check", GROUP)
    assert (result.exit_code, result.stdout) == (
        2,
        "CRITICAL: oldest ready row claimable for 2 h (over 1 h), no live member\n",
    ), result.output


def test_the_limits_come_from_max_age(billing, pgq_env):
    ids = publish(billing, 2)
    age(billing, ids[:1], 90)
    age(billing, ids[1:], 30)  # the oldest counts, not the newest
    result = invoke(pgq_env, "check", GROUP, "--max-age", "1m,2m")
    assert result.exit_code == 1 and result.stdout.startswith(
        "WARNING: oldest ready row claimable for 1 min 30 s (over 1 min)"
    ), result.output
    result = invoke(pgq_env, "check", GROUP, "--max-age", "30,60")
    assert result.exit_code == 2 and "(over 1 min)" in result.stdout, result.output
    result = invoke(pgq_env, "check", GROUP, "--max-age", "120")
    assert result.exit_code == 0 and result.stdout.startswith("OK: "), result.output
    # WARN alone: never worse than WARNING, however long
    result = invoke(pgq_env, "check", GROUP, "--max-age", "1s")
    assert result.exit_code == 1, result.output
    assert monitor.check(billing, GROUP, max_age=(3600.0, None))[0] == "OK"


def test_a_short_limit_passes_with_real_time(billing, pgq_env):
    """No clock moved: a fresh row passes `--max-age 0.3` within a bounded wait."""
    publish(billing, 1)
    result = wait_until(
        lambda: (r := invoke(pgq_env, "check", GROUP, "--max-age", "0.3,60")).exit_code == 1 and r,
        10,
        "the fresh row to pass 0.3 s",
    )
    assert result.stdout.endswith("(over 0.3 s), no live member\n"), result.stdout


def test_rows_waiting_for_a_retry_or_leased_are_not_a_stall(billing, pgq_env):
    ids = publish(billing, 2)
    age(billing, ids[:1], -3600)  # a retry due in an hour: not ready now
    d = t.delivery
    with billing.begin() as conn:  # leased long ago: the lease sweep's business
        conn.execute(
            update(d)
            .where(d.c.message_id == ids[1])
            .values(state="leased", available_at=func.now() - dt.timedelta(hours=3))
        )
    word, line = monitor.check(billing, GROUP)
    assert word == "OK", line
    assert line.endswith("lag 2, committed none, no dead rows, no live member"), line
    assert pgq.status(billing, GROUP)["oldest_ready_age_s"] is None


def test_the_ok_line_says_how_many_members_are_live(billing):
    ids = publish(billing, 1)
    age(billing, ids, 42)
    word, line = monitor.check(billing, GROUP)
    assert (word, line) == (
        "OK",
        "OK: breaker CLOSED (epoch 0), lag 1, committed none, no dead rows, no live member",
    )


def test_the_worst_state_wins(billing, pgq_env):
    ids = publish(billing, 3)
    kill(billing, ids[:1], "message")
    age(billing, ids[1:], 20 * 60)
    result = invoke(pgq_env, "check", GROUP)
    assert (result.exit_code, result.stdout) == (
        2,
        "CRITICAL: 1 dead rows (1 message);"
        " oldest ready row claimable for 20 min (over 15 min), no live member\n",
    )
    with billing.begin() as conn:
        conn.execute(update(t.breaker).values(state="OPEN", epoch=1))
        conn.execute(
            update(t.delivery)
            .where(t.delivery.c.message_id == ids[0])
            .values(state="ready", error_class=None)
        )
    age(billing, ids, 2 * 3600)
    result = invoke(pgq_env, "check", GROUP)
    assert (result.exit_code, result.stdout) == (
        2,
        "CRITICAL: oldest ready row claimable for 2 h (over 1 h), no live member;"
        " breaker open, 0 dead rows pending reconciliation\n",
    )


@pytest.mark.parametrize(
    "bad", ["abc", "0", "-5", "1h,15m", "1,2,3", "", ",", "15m,", "nan", "1e400", "5y"]
)
def test_a_bad_max_age_is_unknown_exit_3(billing, pgq_env, bad):
    result = invoke(pgq_env, "check", GROUP, "--max-age", bad)
    assert result.exit_code == 3, result.output
    assert result.stdout.startswith(f"UNKNOWN: invalid --max-age {bad!r}: use WARN[,CRIT]")
    assert len(result.stdout.splitlines()) == 1 and not result.stderr
    with pytest.raises(UsageError):
        parse_max_age(bad)


def test_max_age_takes_what_the_settings_take():
    assert parse_max_age("15m,1h") == (900.0, 3600.0)
    assert parse_max_age("90,1h30m") == (90.0, 5400.0)
    assert parse_max_age("250ms") == (0.25, None)
    assert parse_max_age("5m,5m") == (300.0, 300.0)


def test_the_line_words_the_live_members_and_the_wait():
    assert [monitor.live_members(*n) for n in [(0, 0), (1, 0), (2, 0), (1, 1), (3, 3), (3, 1)]] == [
        "no live member",
        "1 live member",
        "2 live members",
        "1 live member, its local breaker open",
        "3 live members, every local breaker open",
        "3 live members, 1 with its local breaker open",
    ]
    assert [monitor.span(s) for s in (0.04, 3.25, 59.9, 60, 95, 900, 3600, 7260, 90000)] == [
        "0 s",
        "3.2 s",
        "59.9 s",
        "1 min",
        "1 min 35 s",
        "15 min",
        "1 h",
        "2 h 1 min",
        "1 d 1 h",
    ]


def test_no_consumer_running_in_a_real_process(billing, pgq_env):
    ids = publish(billing, 1)
    age(billing, ids, 2 * 3600)
    proc = subprocess.run(
        [*PGQ, "check", GROUP], env=pgq_env, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (
        2,
        "CRITICAL: oldest ready row claimable for 2 h (over 1 h), no live member\n",
    ), proc.stderr
    proc = subprocess.run(
        [*PGQ, "check", GROUP, "--max-age", "soon"],
        env=pgq_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and proc.stdout.startswith("UNKNOWN: invalid --max-age")
    assert "Traceback" not in proc.stderr


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
    assert "delivery_leased_idx" in text, text  # the run-out leases: one probe too
    assert "Seq Scan" not in text and "Sort" not in text, text
    scan = next(line for line in plan if "delivery_ready_idx" in line)
    assert re.search(r"actual time=\S+ rows=1(\.00)? loops=1", scan), text


# --- the views say it in words --------------------------------------------------------


def test_status_says_stalled_with_no_live_member(billing, pgq_env):
    """Before: nothing said that no one could make progress."""
    publish(billing, 2)
    add_member(billing, "crashed")  # last heard from a minute ago: not live
    add_member(billing, "left-1", left_at=func.now() - dt.timedelta(seconds=30))
    add_member(billing, "left-2", left_at=func.now() - dt.timedelta(seconds=30))
    s = monitor.read_status(billing, GROUP)
    assert s.stalled == "no live member" and (s.live, s.left) == (0, 2)
    result = invoke(pgq_env, "status", GROUP)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1] == "  stalled: no live member"
    assert "  members    0 live of 1, 2 left" in lines
    assert any(line.startswith("  oldest     ready row claimable for ") for line in lines)
    result = invoke(pgq_env, "status")
    assert "billing stalled: no live member" in result.stdout.splitlines()


def test_no_stall_without_rows_ready_now(billing, pgq_env):
    ids = publish(billing, 1)
    age(billing, ids, -3600)
    assert monitor.read_status(billing, GROUP).stalled is None
    result = invoke(pgq_env, "status", GROUP)
    assert "stalled" not in result.stdout


def dashboard_pages(engine: Engine) -> tuple[str, str]:
    """The overview and the group page of a real dashboard app on `engine`."""
    dashboard = Dashboard(engine)
    try:
        app = create_app(dashboard, Guard(None), host="127.0.0.1", port=8080)
        client = app.test_client()
        pages = []
        for path in ("/", f"/groups/{GROUP}"):
            got = client.get(path, headers={"Host": "127.0.0.1:8080"})
            assert got.status_code == 200, got.data
            pages.append(got.get_data(as_text=True))
        return pages[0], pages[1]
    finally:
        dashboard.close()


def test_the_overview_counts_no_departed_member_and_highlights_a_stall(billing):
    """Before: `0/3 live`, plain, counting the two that left cleanly."""
    publish(billing, 1)
    add_member(billing, "crashed")
    add_member(billing, "left-1", left_at=func.now() - dt.timedelta(seconds=30))
    add_member(billing, "left-2", left_at=func.now() - dt.timedelta(seconds=30))
    overview, group = dashboard_pages(billing)
    assert "0/1 live" in overview and "0/3 live" not in overview
    assert '<div class="sub">2 left</div>' in overview
    assert f'<tr data-group="{GROUP}" class=" stalled">' in overview
    assert '<td class="members bad">' in overview
    assert f'<p class="check check-warning stalled" data-group="{GROUP}">' in overview
    assert "stalled: no live member (oldest ready row claimable for" in overview
    assert '<p id="stalled" class="check check-warning">stalled: no live member' in group


def test_the_overview_of_a_group_at_work_shows_no_stall(billing):
    add_member(billing, "left-1", left_at=func.now() - dt.timedelta(seconds=30))
    overview, group = dashboard_pages(billing)
    assert "0/0 live" in overview and "stalled" not in overview
    assert 'id="stalled"' not in group


# --- a lone member whose local breaker is open ------------------------------------------


@pytest.fixture
def lone_tripped(billing: Engine) -> Iterator[pgq.Consumer]:
    """One real member (default `breaker.min_members = 2`) whose every handler call
    fails as systemic: its local breaker opens after four calls and stays open for a
    minute; the group breaker stays CLOSED; most rows were never tried."""
    publish(billing, 40)

    def down(msg: pgq.Message) -> None:
        raise ConnectionError("dependency down")

    settings = {
        **FAST,
        "workers": 1,
        "batch_size": 1,
        "prefetch": 1,
        "max_attempts": 50,
        "breaker_window": 4,
        "breaker_min_calls": 4,
        "breaker_open_for": 60,
        "breaker_open_for_max": 60,
    }
    consumer = pgq.Consumer(billing, GROUP, down, name="lone", **settings)
    consumer.start()
    try:
        wait_until(
            lambda: [m["local_breaker"] for m in monitor.members(billing, GROUP)] == ["open"],
            30,
            "the lone member's local breaker to open",
            describe=lambda: monitor.members(billing, GROUP),
        )
        yield consumer
    finally:
        consumer.stop(timeout=10)


def test_a_lone_member_with_its_local_breaker_open_is_a_stall(billing, pgq_env, lone_tripped):
    """Before: CLOSED, `OK`, and no word of it while nothing moved."""
    result = invoke(pgq_env, "status", GROUP)
    assert result.stdout.splitlines()[1] == "  stalled: every live member's local breaker is open"
    s = pgq.status(billing, GROUP)
    assert s["breaker"]["state"] == "CLOSED" and [m["live"] for m in s["members"]] == [True]
    assert s["oldest_ready_age_s"] is not None
    # the oldest row ready now passes a short limit within a bounded wait
    result = wait_until(
        lambda: (r := invoke(pgq_env, "check", GROUP, "--max-age", "0.5,600")).exit_code == 1 and r,
        10,
        "the check to warn",
    )
    assert result.stdout.startswith("WARNING: oldest ready row claimable for "), result.stdout
    assert result.stdout.endswith("(over 0.5 s), 1 live member, its local breaker open\n"), (
        result.stdout
    )
    overview, group = dashboard_pages(billing)
    assert "stalled: every live member&#39;s local breaker is open" in overview
    assert '<p id="stalled" class="check check-warning">' in group
    assert (
        monitor.read_status(billing, GROUP).stalled == "every live member's local breaker is open"
    )
