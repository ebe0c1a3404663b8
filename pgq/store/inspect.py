"""Reads behind `pgq status`, `members`, `breaker`, `dead` and `check`.

Each function reads one consistent snapshot (one REPEATABLE READ
transaction) and returns the rows as read; `pgq.monitor` shapes them into
the contract's JSON objects.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, Engine, Row

from pgq.breaker import pending_scope
from pgq.sql import admin as aq
from pgq.sql import placement as place
from pgq.sql import status as q
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.members import lock_holders
from pgq.store.placement import Spanning, distributed, nodes_of, spanning
from pgq.store.topics import group_info


@contextlib.contextmanager
def snapshot(engine: Engine) -> Iterator[Connection]:
    """A read-only connection whose statements all see one snapshot."""
    with (
        wrap_errors(),
        engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn,
    ):
        yield conn


@dataclass(frozen=True, slots=True)
class GroupRows:
    """One group as read for `status`: its row, counts, members, the xmin holder, the
    prober and the age of its oldest row ready now."""

    row: Row[Any]
    counts: Mapping[str, Any] | None
    members: list[Row[Any]]
    holder: Row[Any] | None
    prober: str | None
    oldest_ready_age_s: float | None


def _oldest_ready(conn: Connection, gid: int) -> float | None:
    """Seconds the oldest row of group `gid` that is ready now has been claimable,
    None when none is (`q.oldest_ready`: one index probe)."""
    age = conn.execute(q.oldest_ready(), {"group_id": gid}).scalar_one()
    return None if age is None else float(age)


def _probers(conn: Connection, gid: int | None) -> dict[int, str]:
    """The member of each group whose prober lock some session holds (the first by
    name, should two): the prober right now, and no one once its lock session is
    gone. Read from `pg_locks` apart from the group rows (decision 0023, 3.1)."""
    held = lock_holders(conn, gid, "prober")
    probers: dict[int, str] = {}
    for group_id, name in sorted(zip(held["prober_gids"], held["prober_names"], strict=True)):
        probers.setdefault(group_id, name)
    return probers


def _holder(conn: Connection) -> Row[Any] | None:
    return conn.execute(q.frontier_holder()).one_or_none()


def _holders(conn: Connection, gids: list[int]) -> dict[int, Any]:
    """What holds each group's frontier back (`q.frontier_holder`): on one server the
    same backend for every group; on Citus the oldest transaction on the node of the
    group's shard, where its frontier is computed (decision 0023, section 5), asked
    through `run_command_on_workers`."""
    if not distributed(conn):
        holder = _holder(conn)
        return {gid: holder for gid in gids}
    # this read's own backends on the workers hold nothing back: left out
    gpid = int(conn.scalar(place.backend_gpid()))
    query = q.frontier_holder(f"citus_internal gpid={gpid}").compile(
        dialect=conn.dialect, compile_kwargs={"literal_binds": True}
    )
    command = f"SELECT coalesce((SELECT row_to_json(h)::text FROM ({query}) h), '')"
    held = {}
    for r in conn.execute(place.on_workers(), {"command": command}):
        if r.success and r.result:
            held[(r.nodename, r.nodeport)] = SimpleNamespace(**json.loads(r.result))
    nodes = nodes_of(conn, f'"{schema_of(conn)}".delivery', gids)
    return {gid: held.get(node) for gid, node in nodes.items()}


def _members(
    conn: Connection, ttl: float, recent: float | None, gid: int | None = None
) -> list[Row[Any]]:
    """The members of group `gid` (of every group when None): the live ones and those
    that departed within `recent` seconds, or every one when `recent` is None."""
    every = recent is None
    stmt = q.all_members(every) if gid is None else q.group_members(every)
    params: dict[str, Any] = {"ttl": ttl, "recent": recent, "group_id": gid}
    return list(conn.execute(stmt, {**params, **lock_holders(conn, gid, "", ttl=ttl)}))


def group_status(engine: Engine, group: str, member_ttl: float, recent: float | None) -> GroupRows:
    """Everything `status` shows of `group`; raises `UnknownGroup`. Members as
    `member_rows` reads them."""
    with snapshot(engine) as conn:
        return group_status_on(conn, group, member_ttl, recent)


def group_status_on(
    conn: Connection, group: str, member_ttl: float, recent: float | None
) -> GroupRows:
    """`group_status` on `conn`, in its transaction (a member's own connection)."""
    gid = group_info(conn, group).id
    row = conn.execute(q.group_row(), {"group_id": gid}).one()
    counts = conn.execute(q.group_counts(), {"group_id": gid}).one()._asdict()
    members = _members(conn, member_ttl, recent, gid)
    prober = _probers(conn, gid).get(gid)
    oldest = _oldest_ready(conn, gid)
    return GroupRows(row, counts, members, _holders(conn, [gid])[gid], prober, oldest)


def all_group_status(engine: Engine, member_ttl: float, recent: float | None) -> list[GroupRows]:
    """`group_status` of every group, by name, from one snapshot."""
    with snapshot(engine) as conn, spanning(conn, Spanning.GROUPS_OVERVIEW):
        rows = conn.execute(q.all_group_rows()).all()
        probers = _probers(conn, None)
        counts = {r.group_id: r._asdict() for r in conn.execute(q.all_group_counts())}
        members: dict[int, list[Row[Any]]] = {}
        for m in _members(conn, member_ttl, recent):
            members.setdefault(m.group_id, []).append(m)
        holders = _holders(conn, [r.id for r in rows])
        oldest = {r.id: _oldest_ready(conn, r.id) for r in rows}  # an index probe each
    return [
        GroupRows(
            r,
            counts.get(r.id),
            members.get(r.id, []),
            holders.get(r.id),
            probers.get(r.id),
            oldest[r.id],
        )
        for r in rows
    ]


def member_rows(engine: Engine, group: str, ttl: float, recent: float | None) -> list[Row[Any]]:
    """The members of `group` by name, live ones and those that departed within
    `recent` seconds (every one when `recent` is None); raises `UnknownGroup`."""
    with snapshot(engine) as conn:
        return _members(conn, ttl, recent, group_info(conn, group).id)


@dataclass(frozen=True, slots=True)
class BreakerRows:
    """One group's breaker as read for `breaker`: its row, newest transitions and
    newest probes (each newest first)."""

    row: Row[Any]
    history: list[Row[Any]]
    probes: list[Row[Any]]
    prober: str | None


def breaker_rows(engine: Engine, group: str, history_limit: int, probe_limit: int) -> BreakerRows:
    """The group row, its newest `history_limit` breaker transitions and its newest
    `probe_limit` probes, from one snapshot; raises `UnknownGroup`."""
    with snapshot(engine) as conn:
        gid = group_info(conn, group).id
        row = conn.execute(q.group_row(), {"group_id": gid}).one()
        prober = _probers(conn, gid).get(gid)
        history = conn.execute(
            q.breaker_history(), {"group_id": gid, "limit": max(history_limit, 0)}
        )
        probes = conn.execute(q.probes(), {"group_id": gid, "limit": max(probe_limit, 0)})
        return BreakerRows(row, list(history), list(probes), prober)


def dead_rows(
    engine: Engine, group: str, limit: int, error_class: str | None = None
) -> list[Row[Any]]:
    """Up to `limit` dead rows of `group` (of `error_class` only, when given), by
    message id; raises `UnknownGroup`."""
    with snapshot(engine) as conn:
        gid = group_info(conn, group).id
        params = {"group_id": gid, "limit": max(limit, 0), "error_class": error_class}
        return list(conn.execute(q.dead_rows(error_class is not None), params))


def frontier_holder(engine: Engine) -> Row[Any] | None:
    """The backend with the oldest open transaction id in the cluster, or None."""
    with snapshot(engine) as conn:
        return _holder(conn)


@dataclass(frozen=True, slots=True)
class CheckRows:
    """One group as read for `check`: its breaker and counts, its dead rows split by
    cause, how long its oldest row ready now has waited, and its live members."""

    row: Row[Any]
    dead: Row[Any]
    oldest_ready_age_s: float | None
    live: list[Row[Any]]


def check_rows(engine: Engine, group: str, max_refunds: int, member_ttl: float) -> CheckRows:
    """The group's breaker and counts, its dead rows split by cause, the age of its
    oldest row ready now and its live members (`pgq check`), from one snapshot.

    Dead systemic rows that a coming or owed reconciliation will refund count
    as `pending` (see `pgq.breaker.pending_scope`). Members are live as
    `member_rows` says with `member_ttl`.
    """
    with snapshot(engine) as conn:
        return check_rows_on(conn, group, max_refunds, member_ttl)


def check_rows_on(conn: Connection, group: str, max_refunds: int, member_ttl: float) -> CheckRows:
    """`check_rows` on `conn`, in its transaction (a member's own connection)."""
    gid = group_info(conn, group).id
    row = conn.execute(aq.check_group(), {"gid": gid}).one()
    scope = pending_scope(row.state, int(row.epoch), row.reconcile_epoch, row.reconcile_from_epoch)
    params = {
        "gid": gid,
        "max_refunds": max_refunds,
        "pending_from": scope[0] if scope else None,
        "pending_to": scope[1] if scope else None,
    }
    dead = conn.execute(aq.check_dead(), params).one()
    live = [m for m in _members(conn, member_ttl, 0.0, gid) if m.live]
    return CheckRows(row, dead, _oldest_ready(conn, gid), live)
