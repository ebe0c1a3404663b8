"""Forgetting departed members: the statement behind the maintenance task that keeps
the member table from growing by one row per `--until-empty` run, for ever.

The statements of a member's own life (join, heartbeat, leave) are in
`pgq.store.membership`; this one is about the other members of the group.
"""

from __future__ import annotations

import datetime as dt
from contextlib import nullcontext
from typing import Any

from sqlalchemy import Connection

from pgq.sql import members as member_sql
from pgq.store.engine import schema_of
from pgq.store.placement import Spanning, spanning


def member_table(conn: Connection) -> str:
    """The schema-qualified name of the member table (its oid keys the members' locks)."""
    return f'"{schema_of(conn)}".member'


def lock_holders(
    conn: Connection,
    gid: int | None,
    purpose: str,
    *,
    ttl: float | None = None,
    after: float | None = None,
) -> dict[str, Any]:
    """The members of group `gid` (every group when None) that hold their `purpose`
    lock ("" their session lock; "prober"), as the parameters
    `pgq.sql.members.holds` takes: read the names, then test `pg_locks` in a statement
    of its own (decision 0023, 3.1). Only names that can matter are tested: with
    `ttl`, the members heard from within `ttl` seconds (only they can be live); with
    `after`, those departed more than `after` seconds ago (`forget_departed`).

    Two reads, not one: a member whose lock goes between them still counts as
    holding it (see `GroupStore.open_on_quorum` for the statement where that matters).
    """
    scope = "fresh" if ttl is not None else "departed" if after is not None else "all"
    bounds = {
        "gid": gid,
        "ttl": dt.timedelta(seconds=ttl or 0),
        "after": dt.timedelta(seconds=after or 0),
    }
    with spanning(conn, Spanning.MEMBERS_OVERVIEW) if gid is None else nullcontext():
        rows = conn.execute(member_sql.member_names(gid is None, scope), bounds).all()
    params: dict[str, Any] = {"table": member_table(conn)}
    found = (
        conn.execute(
            member_sql.holding(purpose),
            {"gids": [r.group_id for r in rows], "names": [r.name for r in rows], **params},
        ).all()
        if rows
        else []
    )
    prefix = member_sql.HOLDERS[purpose]
    params[f"{prefix}_gids"] = [r.group_id for r in found]
    params[f"{prefix}_names"] = [r.name for r in found]
    return params


def forget_departed(conn: Connection, gid: int, after: float) -> list[str]:
    """Delete the members of group `gid` that left or died more than `after` seconds
    ago, never one whose session still holds its lock nor one whose name still
    holds a lease; returns their names."""
    params = {
        "gid": gid,
        "after": dt.timedelta(seconds=after),
        **lock_holders(conn, gid, "", after=after),
    }
    return [row.name for row in conn.execute(member_sql.forget_departed(), params)]
