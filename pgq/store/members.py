"""Forgetting departed members: the statement behind the maintenance task that keeps
the member table from growing by one row per `--until-empty` run, for ever.

The statements of a member's own life (join, heartbeat, leave) are `GroupStore`'s;
this one is about the other members of the group.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Connection

from pgq.sql import members as member_sql


def forget_departed(conn: Connection, gid: int, after: float) -> list[str]:
    """Delete the members of group `gid` that left or died more than `after` seconds
    ago, never one whose session still holds its lock nor one whose name still
    holds a lease; returns their names."""
    params = {"gid": gid, "after": dt.timedelta(seconds=after)}
    return [row.name for row in conn.execute(member_sql.forget_departed(), params)]
