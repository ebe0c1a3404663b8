"""The charts' samples (decision 0045): one row per group per minute, written by
the first of its members and the dashboard that gets there, read back after any
restart, kept a day."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from helpers import FAST, kill, wait_until
from roles import login_role
from sqlalchemy import Engine, delete, func, insert, select, text
from sqlalchemy.exc import ProgrammingError

import pgq
from pgq import schema as t
from pgq.store import samples as store_samples
from pgq.store.migrations import LATEST
from pgq.store.privileges import grant
from pgq.store.topics import group_info


def gid_of(engine: Engine, group: str = "billing") -> int:
    return group_info(engine, group).id


def sample_rows(engine: Engine, group: str = "billing") -> list[dict[str, object]]:
    s = t.group_sample
    with engine.connect() as conn:
        found = conn.execute(
            select(s).where(s.c.group_id == gid_of(engine, group)).order_by(s.c.at)
        )
        return [dict(r) for r in found.mappings()]


def take(engine: Engine, group: str = "billing") -> pgq.read_models.GroupSample | None:
    with engine.begin() as conn:
        return store_samples.take_sample(conn, gid_of(engine, group))


def test_the_first_sample_of_a_minute_wins_and_holds_the_groups_numbers(orders: Engine):
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(5)])
    kill(orders, ids[:2], "message")
    first = take(orders)
    assert first is not None
    assert (first.lag, first.dead, first.done) == (3, 2, 0)
    assert first.oldest_ready_age_s is not None and first.oldest_ready_age_s >= 0
    assert first.at.second == 0 and first.at.microsecond == 0  # the minute's start
    assert take(orders) is None  # the minute has its sample: nothing read, nothing written
    [row] = sample_rows(orders)
    assert (row["lag"], row["dead"], row["at"]) == (3, 2, first.at)


def test_a_group_with_nothing_ready_has_no_oldest_age(orders: Engine):
    sample = take(orders)
    assert sample is not None and sample.oldest_ready_age_s is None and sample.lag == 0


@contextmanager
def running(engine: Engine, group: str = "billing", **settings: object) -> Iterator[pgq.Consumer]:
    consumer = pgq.Consumer(engine, group, lambda msg: None, **{**FAST, **settings})
    consumer.start()
    try:
        yield consumer
    finally:
        consumer.stop(timeout=10)


def backdate(engine: Engine, ago: dt.timedelta, group: str = "billing", lag: int = 7) -> None:
    """A sample of `ago` before now, as an earlier writer left it."""
    s = t.group_sample
    with engine.begin() as conn:
        at = conn.scalar(select(func.date_trunc("minute", func.now() - ago)))
        conn.execute(
            insert(s).values(group_id=gid_of(engine, group), at=at, done=1, lag=lag, dead=0)
        )


def test_a_running_member_writes_its_groups_sample_and_retention_drops_old_ones(orders: Engine):
    backdate(orders, dt.timedelta(days=2))
    backdate(orders, dt.timedelta(hours=3), lag=9)
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(20)])
    with running(orders):
        wait_until(lambda: len(sample_rows(orders)) == 2, 20, "the member's sample")
    kept = sample_rows(orders)
    assert kept[0]["lag"] == 9  # three hours old: kept
    assert kept[1]["at"] > kept[0]["at"]


def test_unsubscribe_removes_the_groups_samples(orders: Engine):
    take(orders)
    gid = gid_of(orders)
    pgq.unsubscribe(orders, "billing", reason="test")
    s = t.group_sample
    with orders.connect() as conn:
        assert conn.scalar(select(func.count()).where(s.c.group_id == gid)) == 0


@pytest.mark.parametrize("span", [3600.0, 86400.0])
def test_samples_are_read_by_span(orders: Engine, span: float):
    backdate(orders, dt.timedelta(hours=3), lag=9)
    take(orders)
    found = store_samples.group_samples(orders, "billing", span)
    assert len(found) == (1 if span == 3600.0 else 2)
    assert store_samples.all_samples(orders, span)["billing"] == found


@pytest.mark.parametrize("orders_groups", [("billing", "other")])
def test_the_migration_restricts_the_samples_for_roles_restricted_before(
    orders: Engine, pg_dsn: str, schema: str
):
    """A role restricted to `billing` (decision 0034) before schema version 9 sees and
    writes only `billing`'s samples after it, as on the other group tables."""
    with login_role(pg_dsn) as (role, dsn):
        grant(orders, role, "consumer", groups=["billing"])
        with orders.begin() as conn:  # as before version 9: no table, no grants on it
            conn.execute(text(f'DROP TABLE "{schema}".group_sample'))
            conn.execute(delete(t.schema_version).where(t.schema_version.c.version >= 9))
        assert pgq.migrate(orders) == LATEST
        take(orders, "billing")
        take(orders, "other")
        restricted = pgq.connect(dsn, schema=schema)
        try:
            seen = store_samples.all_samples(restricted, 3600)
            assert set(seen) == {"billing"}
            with pytest.raises(ProgrammingError, match="row-level security policy"):
                with restricted.begin() as conn:
                    conn.execute(
                        insert(t.group_sample).values(
                            group_id=gid_of(orders, "other"),
                            at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
                            done=0,
                            lag=0,
                            dead=0,
                        )
                    )
        finally:
            restricted.dispose()
