"""A member's own life in `GroupStore`: join, heartbeat, leave, drain state."""

from __future__ import annotations

import datetime as dt
import os
import socket
from typing import Any

from sqlalchemy import Connection

from pgq.errors import UnknownGroup
from pgq.records import (
    DrainState,
)
from pgq.sql import lifecycle as lifecycle_sql
from pgq.sql import members as member_sql
from pgq.sql import status as status_sql
from pgq.sql.locks import (
    group_key,
    xact_lock_shared,
)
from pgq.store.engine import schema_of
from pgq.store.members import lock_holders
from pgq.store.scope import GroupScope, present_holders


class Membership(GroupScope):
    """This member's own life in the group: join (or take its name over), heartbeat,
    leave, and what it reads of the group to decide a drain (`pgq.store.members` is
    about the other members)."""

    def join(self, conn: Connection, ttl: float, takeover: bool) -> bool:
        """Register this member; False when a live member already has the name.

        `takeover`: the caller holds the member's session lock (so whoever had the
        name before is gone); without it, only a row not heard from within `ttl`
        is taken over.

        Two statements (insert a new row, else take the existing one over); a row
        deleted between them (`forget_departed`) makes the name free, so the insert
        is tried once more. Of concurrent starters exactly one joins.

        First it waits for an unsubscribe of the group under way (the group lock,
        shared; `pgq.store.lifecycle.unsubscribe` takes it exclusively), then
        raises `UnknownGroup` when the group is gone: a member never registers in
        a removed group."""
        conn.execute(xact_lock_shared(group_key(schema_of(conn), self.group)))
        if conn.execute(lifecycle_sql.group_exists(), {"gid": self.gid}).first() is None:
            raise UnknownGroup(f"group {self.group!r} was removed (pgq unsubscribe)")
        params = {
            "gid": self.gid,
            "member": self.member,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ttl": dt.timedelta(seconds=ttl),
            "takeover": takeover,
        }
        for _ in range(2):
            row = conn.execute(member_sql.join_new(), params).one_or_none()
            if row is None:
                row = conn.execute(member_sql.join_existing(), params).one_or_none()
            if row is not None:
                self.started = row.started_at
                return True
        return False

    def _me(self) -> dict[str, Any]:
        return {"gid": self.gid, "member": self.member, "started": self.started}

    def heartbeat(
        self, conn: Connection, local: str, tripped_epoch: int | None
    ) -> tuple[str, int] | None:
        """Record liveness and local breaker state; returns (group state, epoch), or
        None when another process has taken this member's name over."""
        params = {**self._me(), "local": local, "tripped_epoch": tripped_epoch}
        row = conn.execute(member_sql.heartbeat(), params).one_or_none()
        return None if row is None else (str(row.state), int(row.epoch))

    def leave(self, conn: Connection) -> None:
        """Mark this member as gone (not the process that took its name over)."""
        conn.execute(member_sql.leave(), self._me())

    def lag(self, conn: Connection) -> int:
        """The group's messages not yet resolved (ready + leased), as `pgq status`."""
        return int(conn.execute(status_sql.group_lag(), {"gid": self.gid}).scalar() or 0)

    def drain_state(self, conn: Connection, ttl: float, wait: float = 0.0) -> DrainState:
        """Rows ready now, waiting for retry (and of those, due within `wait` seconds),
        and leased by us or by members that are not live.

        Liveness is read apart from the statement (`lock_holders`), so the holders
        are read again after it, and the statement runs again with them until both
        reads agree: a member killed between the first read and the statement would
        count as live, and a drain would end with its rows still leased (as the
        quorum open does, `open_on_quorum`)."""
        holders = lock_holders(conn, self.gid, "", ttl=ttl)
        while True:
            params = {
                **holders,
                "gid": self.gid,
                "member": self.member,
                "ttl": dt.timedelta(seconds=ttl),
                "wait": dt.timedelta(seconds=wait),
            }
            state = DrainState(**conn.execute(member_sql.drain_state(), params).mappings().one())
            after = lock_holders(conn, self.gid, "", ttl=ttl)
            if present_holders(after) == present_holders(holders):
                return state
            holders = after
