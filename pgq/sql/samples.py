"""Statements behind the charts' samples: one row per group per minute in
`group_sample` (decision 0045).

A sample is read and written in two statements, each about one group (on Citus
routed to the group's shard, beside its delivery rows): `due_sample` answers
the minute and the group's numbers only when the minute has no sample yet, and
`write_sample` inserts them unless another writer got there first. Every
number is cheap to read on a group of any size:

- `done`: `group_state.done_pruned`, one row (counting `done` rows would read
  every row of the group: the ack deletes what it finishes, the counter counts it);
- `lag`: ready + leased, each counted through its partial index (as the
  progress line reads it, `pgq.sql.status.group_lag`);
- `dead`: dead rows through `delivery_failed_idx` (rows with an error class);
- `oldest_ready_age_s`: two index probes (`pgq.sql.status.oldest_ready`).

`due_sample`'s test for the minute's row is an uncorrelated `NOT EXISTS`: the
planner makes it a one-time filter, evaluated before the counts, so a writer
that comes second in a minute reads one index entry and nothing else.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import Float, Integer, Interval, bindparam, func, literal_column, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.sql import Executable, Select

from pgq import schema as t
from pgq.sql.status import oldest_ready_age

BUCKET = "minute"
"""The `date_trunc` field a sample's `at` is truncated to: one sample a minute."""

_COLUMNS = ("at", "done", "lag", "dead", "oldest_ready_age_s")
"""What a sample holds besides its group, in the order the reads return it."""


def _gid() -> Any:
    return bindparam("gid", type_=Integer)


def _minute() -> Any:
    return func.date_trunc(literal_column(f"'{BUCKET}'"), func.now())


def _count(*where: Any) -> Any:
    d = t.delivery
    return select(func.count()).where(d.c.group_id == _gid(), *where).scalar_subquery()


@cache
def due_sample() -> Select[Any]:
    """The current minute and group `:gid`'s numbers (`at`, `done`, `lag`, `dead`,
    `oldest_ready_age_s`), or no row when the minute already has its sample."""
    d, gs, s = t.delivery, t.group_state, t.group_sample
    done = select(gs.c.done_pruned).where(gs.c.group_id == _gid()).scalar_subquery()
    taken = select(s.c.at).where(s.c.group_id == _gid(), s.c.at == _minute()).exists()
    return select(
        _minute().label("at"),
        func.coalesce(done, 0).label("done"),
        (
            _count(d.c.state == t.READY) + _count(d.c.state == t.LEASED)  # the partial indexes
        ).label("lag"),
        _count(d.c.error_class.is_not(None), d.c.state == t.DEAD).label("dead"),
        oldest_ready_age(_gid()).label("oldest_ready_age_s"),
    ).where(~taken)


@cache
def write_sample() -> Executable:
    """Insert group `:gid`'s sample of minute `:at` (`:done`, `:lag`, `:dead`,
    `:oldest_ready_age_s`) unless it is there already; returns its `at` when written."""
    s = t.group_sample
    values = {"group_id": _gid(), **{name: bindparam(name) for name in _COLUMNS}}
    values["oldest_ready_age_s"] = bindparam("oldest_ready_age_s", type_=Float)
    return (
        insert(s)
        .values(values)
        .on_conflict_do_nothing(index_elements=[s.c.group_id, s.c.at])
        .returning(s.c.at)
    )


@cache
def group_samples() -> Select[Any]:
    """Group `:gid`'s samples of the last `:span` (an interval), oldest first."""
    s = t.group_sample
    return (
        select(*(s.c[name] for name in _COLUMNS))
        .where(s.c.group_id == _gid(), s.c.at >= func.now() - bindparam("span", type_=Interval))
        .order_by(s.c.at)
    )


@cache
def all_samples() -> Select[Any]:
    """Every group's samples of the last `:span`, by group name then time, the group's
    name as `group` (the overview: on Citus one task per shard, as `pgq status`'s
    counts of every group)."""
    s, g = t.group_sample, t.consumer_group
    return (
        select(g.c.name.label("group"), *(s.c[name] for name in _COLUMNS))
        .select_from(s.join(g, g.c.id == s.c.group_id))
        .where(s.c.at >= func.now() - bindparam("span", type_=Interval))
        .order_by(g.c.name, s.c.at)
    )


@cache
def group_ids() -> Select[Any]:
    """Every group's id (the dashboard samples each)."""
    g = t.consumer_group
    return select(g.c.id).order_by(g.c.id)


@cache
def delete_expired_samples() -> Executable:
    """Delete group `:gid`'s samples older than `:keep` (an interval); returns how many.
    By the primary key's range (group, at): it reads only what it deletes."""
    s = t.group_sample
    deleted = (
        s.delete()
        .where(s.c.group_id == _gid(), s.c.at < func.now() - bindparam("keep", type_=Interval))
        .returning(s.c.at)
        .cte("deleted")
    )
    return select(func.count()).select_from(deleted)


__all__ = [
    "BUCKET",
    "all_samples",
    "delete_expired_samples",
    "due_sample",
    "group_ids",
    "group_samples",
    "write_sample",
]
