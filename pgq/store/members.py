"""Forgetting departed members: the statement behind the maintenance task that keeps
the member table from growing by one row per `--until-empty` run, for ever.

The statements of a member's own life (join, heartbeat, leave) are `GroupStore`'s;
this one is about the other members of the group.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection

from pgq.sql import members as member_sql
from pgq.store.engine import schema_of


def member_table(conn: Connection) -> str:
    """The schema-qualified name of the member table (its oid keys the members' locks)."""
    return f'"{schema_of(conn)}".member'


def lock_holders(conn: Connection, gid: int | None, *purposes: str) -> dict[str, Any]:
    """The members of group `gid` (every group when None) that hold each lock of
    `purposes` ("" their session lock; "prober"), as the parameters
    `pgq.sql.members.holds` takes: read the names, then test `pg_locks` in a statement
    of its own (decision 0023, 3.1). A member that joins in between counts as not
    holding: liveness read this way errs towards "not live", as a heartbeat a moment
    late would."""
    rows = conn.execute(member_sql.member_names(gid is None), {"gid": gid}).all()
    names = {"gids": [r.group_id for r in rows], "names": [r.name for r in rows]}
    params: dict[str, Any] = {"table": member_table(conn)}
    for purpose in purposes:
        prefix = member_sql.HOLDERS[purpose]
        found = conn.execute(member_sql.holding(purpose), {**names, **params}).all() if rows else []
        params[f"{prefix}_gids"] = [r.group_id for r in found]
        params[f"{prefix}_names"] = [r.name for r in found]
    return params


def forget_departed(conn: Connection, gid: int, after: float) -> list[str]:
    """Delete the members of group `gid` that left or died more than `after` seconds
    ago, never one whose session still holds its lock nor one whose name still
    holds a lease; returns their names."""
    params = {"gid": gid, "after": dt.timedelta(seconds=after), **lock_holders(conn, gid, "")}
    return [row.name for row in conn.execute(member_sql.forget_departed(), params)]
