"""Reading a message's history in a group (`pgq.sql.history`): the dashboard's
message page shows it."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Engine

from pgq.read_models import HistoryLine, MessageHistory, MessageProbe, Transition
from pgq.records import BreakerState
from pgq.sql import history as q
from pgq.store.inspect import snapshot
from pgq.store.topics import group_info

__all__ = ["message_history"]


def message_history(
    engine: Engine, group: str, message_id: int, published: dt.datetime
) -> MessageHistory:
    """Message `message_id`'s history in `group` (published at `published`), from one
    snapshot; raises `UnknownGroup`. `lines_written` is the row's `events` while the
    group holds it (retention takes lines older than it even then), else the newest
    line's number."""
    with snapshot(engine) as conn:
        gid = group_info(conn, group).id
        which = {"gid": gid, "message_id": message_id}
        lines = tuple(HistoryLine(**row._mapping) for row in conn.execute(q.lines(), which))
        events = conn.execute(q.events_of(), which).scalar() or 0
        probes = tuple(MessageProbe(**row._mapping) for row in conn.execute(q.probes_of(), which))
        transitions = conn.execute(q.transitions_since(), {"gid": gid, "since": published})
        breaker = tuple(
            Transition(r.epoch, BreakerState(r.state), r.at, r.refunded, r.by_member)
            for r in transitions
        )
    # the row's count where it is still there: retention may have taken every line of
    # a row it still holds (a dead row older than it); else the newest line kept
    written = max(events, lines[-1].n if lines else 0)
    return MessageHistory(lines, written, probes, breaker)
