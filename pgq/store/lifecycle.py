"""A group's and a topic's life past `subscribe`: `topics`, `unsubscribe`, `delete_topic`.

`unsubscribe` removes a group with every row it has, so that it no longer holds
back retention; `delete_topic` removes a topic without groups with its messages.
Each writes one `audit` row in the same transaction (the group's rows, or the
topic's, keep the names, so `pgq audit` still shows the trail afterwards). Why
they lock what they lock, and delete the way they do: decision 0033.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from pgq.errors import UnknownTopic, UsageError
from pgq.names import check_name
from pgq.read_models import TopicGroup, TopicInfo, Topics
from pgq.schema import NO_GROUP
from pgq.settings import DEFAULTS
from pgq.sql import admin as admin_sql
from pgq.sql import lifecycle as q
from pgq.sql import publish as publish_sql
from pgq.sql.locks import group_key, topic_key, topic_lock, xact_lock
from pgq.store import placement
from pgq.store.admin import MAX_LISTED_IDS, audit_names, check_reason, default_actor
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.inspect import snapshot
from pgq.store.members import lock_holders
from pgq.store.placement import Spanning, spanning
from pgq.store.topics import group_info

logger = logging.getLogger(__name__)

_SHOWN_MEMBERS = 5


@dataclass(frozen=True, slots=True)
class Unsubscribed:
    """What one unsubscribe did: the group's delivery rows deleted, the live members
    it removed with `force` (their names), and the audit row that records it."""

    count: int
    forced: tuple[str, ...]
    audit_id: int


@dataclass(frozen=True, slots=True)
class TopicDeleted:
    """What one topic delete did: the messages deleted, and the audit row."""

    count: int
    audit_id: int


def topics(engine: Engine) -> Topics:
    """Every topic by name: the messages it retains and its groups (one snapshot)."""
    with snapshot(engine) as conn:
        rows = conn.execute(q.topics_with_groups()).all()
        with spanning(conn, Spanning.TOPIC_MESSAGE_COUNTS):
            by_topic = conn.execute(q.messages_by_topic()).all()
        counts = {int(r.topic_id): int(r.n) for r in by_topic}
    return Topics(
        tuple(
            TopicInfo(
                name=r.name,
                messages=int(counts.get(r.id, 0)),
                groups=tuple(
                    TopicGroup(name, bool(ordered))
                    for name, ordered in zip(r.groups, r.ordered, strict=False)
                ),
                created_at=r.created_at,
            )
            for r in rows
        )
    )


def lock_topic(conn: Connection, topic: str) -> int | None:
    """Lock topic `topic` as a subscribe does (exclusively: publishers and retention
    of the topic wait for this transaction, and it for them); its id, None when
    there is no such topic. A statement of its own: the later ones see every
    publish that held the lock."""
    if placement.distributed(conn):
        conn.execute(topic_lock(shared=False), {"key": topic_key(schema_of(conn), topic)})
        return conn.execute(publish_sql.topic_id(), {"name": topic}).scalar()
    return conn.execute(publish_sql.lock_topic_for_subscribe(), {"name": topic}).scalar()


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN_MEMBERS])
    more = len(names) - _SHOWN_MEMBERS
    return f"{shown} and {more} more" if more > 0 else shown


def unsubscribe(
    engine: Engine,
    group: str,
    *,
    reason: str,
    force: bool = False,
    member_ttl: float = float(DEFAULTS["breaker_member_ttl"]),
    actor: str | None = None,
    max_listed: int = MAX_LISTED_IDS,
) -> Unsubscribed:
    """Remove `group`: its delivery rows, members, probes, breaker and its history,
    its state and the group itself, so that it no longer holds back retention;
    audited (action `unsubscribe`: the delivery rows deleted, at most `max_listed`
    of their message ids, `reason`, `actor`, the database role).

    Refused (`UsageError`) while a member is live (DESIGN §6.2: it holds its
    session lock and was heard from within `member_ttl` seconds) unless `force`:
    then a live member finds its group gone and stops. A member that starts
    meanwhile either joined before (and is live: refused) or waits for this
    transaction and then fails with `UnknownGroup` (the group lock,
    `pgq.sql.locks.group_key`). Publishers of the topic wait for it to commit
    (the topic lock, as a subscribe takes it), so no delivery row is written for
    the group once it is gone. Raises `UnknownGroup`, and `UsageError` for an
    empty reason.
    """
    check_name("group", group)
    params: dict[str, Any] = {
        "reason": check_reason(reason, "unsubscribe"),
        "actor": actor or default_actor(),
        "max_listed": max_listed,
    }
    with wrap_errors(), engine.begin() as conn:
        conn.execute(xact_lock(group_key(schema_of(conn), group)))
        info = group_info(conn, group)
        if lock_topic(conn, info.topic) is None:  # not while the group exists
            raise UnknownTopic(f"unknown topic {info.topic!r}")
        params.update(audit_names(info))
        live = lock_holders(conn, info.id, "", ttl=member_ttl)["present_names"]
        if live and not force:
            raise UsageError(
                f"group {group!r} has {len(live)} live member(s): {_names(live)};"
                " stop them first, or unsubscribe with --force"
            )
        gone = conn.execute(q.delete_deliveries(), params).one()
        for table in q.GROUP_TABLES:
            conn.execute(q.delete_group_rows(table.name), params)
        conn.execute(q.delete_group(), params)
        audit = admin_sql.insert_audit(q.UNSUBSCRIBE_ACTION)
        audit_id = conn.execute(audit, {**params, "ids": gone.ids, "count": gone.n}).scalar_one()
    logger.info(
        "group removed group=%s topic=%s rows=%d forced=%d",
        group,
        info.topic,
        gone.n,
        len(live),
    )
    return Unsubscribed(count=int(gone.n), forced=tuple(live), audit_id=int(audit_id))


def delete_topic(
    engine: Engine,
    name: str,
    *,
    reason: str,
    actor: str | None = None,
    max_listed: int = MAX_LISTED_IDS,
) -> TopicDeleted:
    """Delete topic `name` and every message it retains; audited (action
    `delete-topic`, `pgq audit --topic NAME`: the messages deleted, at most
    `max_listed` of their ids, `reason`, `actor`, the database role).

    Refused (`UsageError`) while a group is subscribed to it (unsubscribe them
    first). Takes the topic's lock as a subscribe does: a publish waiting for it
    then finds no topic (`UnknownTopic`), and so does a subscribe. Raises
    `UnknownTopic`, and `UsageError` for an empty reason.
    """
    check_name("topic", name)
    params: dict[str, Any] = {
        "reason": check_reason(reason, "topic delete"),
        "actor": actor or default_actor(),
        "max_listed": max_listed,
        "gid": NO_GROUP,
        "group_name": None,
        "topic": name,
    }
    with wrap_errors(), engine.begin() as conn:
        topic_id = lock_topic(conn, name)
        if topic_id is None:
            raise UnknownTopic(f"unknown topic {name!r}")
        params["topic_id"] = topic_id
        groups = list(conn.execute(q.groups_of_topic(), params).scalars())
        if groups:
            raise UsageError(
                f"topic {name!r} has {len(groups)} group(s) subscribed: {_names(groups)};"
                " unsubscribe them first"
            )
        gone = conn.execute(q.delete_messages(), params).one()
        audit = admin_sql.insert_audit(q.DELETE_TOPIC_ACTION)
        audit_id = conn.execute(audit, {**params, "ids": gone.ids, "count": gone.n}).scalar_one()
        conn.execute(q.delete_topic(), params)
    logger.info("topic deleted topic=%s messages=%d", name, gone.n)
    return TopicDeleted(count=int(gone.n), audit_id=int(audit_id))


__all__ = [
    "TopicDeleted",
    "Unsubscribed",
    "delete_topic",
    "lock_topic",
    "topics",
    "unsubscribe",
]
