"""The charts' samples (decision 0045): take a group's sample of this minute, read
a group's or every group's samples, expire the old ones.

A sample is taken by whoever runs: each member of the group (a maintenance
task) and the dashboard (its sampler, every group). The first writer of a minute
wins; the others read one index entry and stop (`pgq.sql.samples`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection, Engine

from pgq.read_models import GroupSample
from pgq.sql import samples as q
from pgq.store.errors import wrap_errors
from pgq.store.placement import Spanning, spanning
from pgq.store.topics import group_info

__all__ = [
    "SAMPLE_KEEP",
    "all_samples",
    "expire_samples",
    "group_samples",
    "sample_every_group",
    "take_sample",
]

SAMPLE_KEEP = 25 * 3600.0
"""Seconds a sample is kept: the longest chart spans a day, and an hour more lets a
late retention pass miss nothing that chart draws."""


def _sample(row: Any) -> GroupSample:
    return GroupSample(
        at=row["at"],
        done=int(row["done"]),
        lag=int(row["lag"]),
        dead=int(row["dead"]),
        oldest_ready_age_s=(
            None if row["oldest_ready_age_s"] is None else float(row["oldest_ready_age_s"])
        ),
    )


def take_sample(conn: Connection, gid: int) -> GroupSample | None:
    """Group `gid`'s sample of this minute, written unless the minute has one; the
    sample written, or None (someone else wrote it, now or before)."""
    row = conn.execute(q.due_sample(), {"gid": gid}).mappings().one_or_none()
    if row is None:
        return None
    written = conn.execute(q.write_sample(), {"gid": gid, **row}).first()
    return None if written is None else _sample(row)


def expire_samples(conn: Connection, gid: int, keep: float = SAMPLE_KEEP) -> int:
    """Delete group `gid`'s samples older than `keep` seconds; returns how many."""
    params = {"gid": gid, "keep": dt.timedelta(seconds=keep)}
    return int(conn.execute(q.delete_expired_samples(), params).scalar() or 0)


def sample_every_group(engine: Engine) -> int:
    """This minute's sample of every group that has none yet, one short transaction
    per group (on Citus routed to its shard); returns how many it wrote."""
    with wrap_errors():
        with engine.connect() as conn:
            gids = [int(g) for g in conn.execute(q.group_ids()).scalars()]
        written = 0
        for gid in gids:
            with engine.begin() as conn:
                written += take_sample(conn, gid) is not None
    return written


def group_samples(engine: Engine, group: str, span: float) -> list[GroupSample]:
    """`group`'s samples of the last `span` seconds, oldest first; raises `UnknownGroup`."""
    with wrap_errors(), engine.connect() as conn:
        gid = group_info(conn, group).id
        params = {"gid": gid, "span": dt.timedelta(seconds=span)}
        return [_sample(r) for r in conn.execute(q.group_samples(), params).mappings()]


def all_samples(engine: Engine, span: float) -> dict[str, list[GroupSample]]:
    """Every group's samples of the last `span` seconds, by group name, oldest first."""
    found: dict[str, list[GroupSample]] = {}
    with wrap_errors(), engine.connect() as conn, spanning(conn, Spanning.SAMPLES_OVERVIEW):
        # rows as plain tuples, in `_COLUMNS`' order: the overview of 500 groups reads
        # 30,000 of them, and mapping each by name cost more than the read
        rows = conn.execute(q.all_samples(), {"span": dt.timedelta(seconds=span)})
        for group, at, done, lag, dead, age in rows:
            found.setdefault(group, []).append(GroupSample(at, done, lag, dead, age))
    return found
