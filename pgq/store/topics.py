"""Topics, groups and publishing: `create_topic`, `subscribe`, `publish`, `publish_many`."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import psycopg
from sqlalchemy import Connection, Engine

from pgq.errors import InvalidPayload, PermissionDenied, UnknownGroup, UnknownTopic, UsageError
from pgq.names import check_name
from pgq.records import GroupInfo
from pgq.sql import publish as q
from pgq.sql.locks import topic_key, topic_lock
from pgq.store import placement
from pgq.store.connections import driver_sql
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.privileges import require_privileges

Bind = Engine | Connection


@contextlib.contextmanager
def _transaction(target: Bind) -> Iterator[Connection]:
    """A connection in a transaction: the caller's, or a new one committed on exit."""
    if isinstance(target, Connection):
        yield target
        return
    with target.begin() as conn:
        yield conn


def create_topic(target: Bind, name: str) -> None:
    """Create topic `name` (idempotent)."""
    check_name("topic", name)
    with wrap_errors(), _transaction(target) as conn:
        conn.execute(q.create_topic(), {"name": name})


def subscribe(
    target: Bind, group: str, topic: str, start: Literal["earliest", "latest"] = "earliest"
) -> None:
    """Create consumer group `group` on `topic` (idempotent).

    With `start="earliest"` the group gets a delivery row for every retained
    message of the topic; with `"latest"` only messages published after this
    call commits. Waits for publishing transactions that are still open, so no
    message is left without the new group's row.
    """
    check_name("group", group)
    check_name("topic", topic)
    if start not in ("earliest", "latest"):
        raise UsageError(f"invalid start {start!r}: use 'earliest' or 'latest'")
    with wrap_errors(), _transaction(target) as conn:
        if placement.distributed(conn):
            conn.execute(topic_lock(shared=False), {"key": topic_key(schema_of(conn), topic)})
            # the publishes that released the lock have committed on the coordinator,
            # not yet everywhere: a message still prepared on its node is invisible
            # to the backfill (tests/citus/test_two_phase.py)
            before = placement.cutoff(conn)
            placement.wait_for_commits(conn, before, f"subscribe {group!r}")
            topic_id = conn.execute(q.topic_id(), {"name": topic}).scalar()
        else:
            topic_id = conn.execute(q.lock_topic_for_subscribe(), {"name": topic}).scalar()
        if topic_id is None:
            raise UnknownTopic(f"unknown topic {topic!r}")
        params = {"name": group, "topic_id": topic_id, "start": start}
        group_id = conn.execute(q.insert_group(), params).scalar()
        if group_id is None:
            existing = conn.execute(q.group_by_name(), {"name": group}).one()
            if existing.topic != topic:
                raise UsageError(
                    f"group {group!r} already exists on topic {existing.topic!r}, not {topic!r}"
                )
            return
        conn.execute(q.insert_group_state(), {"gid": group_id})
        conn.execute(q.insert_breaker(), {"gid": group_id})
        if start == "earliest":
            conn.execute(q.backfill_group(), {"gid": group_id, "topic_id": topic_id})


def group_info(target: Bind, group: str) -> GroupInfo:
    """The group as stored; raises `UnknownGroup`."""
    check_name("group", group)
    with wrap_errors(), _transaction(target) as conn:
        row = conn.execute(q.group_by_name(), {"name": group}).mappings().one_or_none()
    if row is None:
        raise UnknownGroup(f"unknown group {group!r}")
    return GroupInfo(**row)


def to_json(value: Any) -> str:
    """`value` as JSON text; raises `InvalidPayload` if it is not JSON-serialisable."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidPayload("payload is not JSON-serialisable: nested too deeply") from None


def publish_many(
    target: Bind,
    topic: str,
    payloads: Iterable[Any],
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    delay: float | None = None,
) -> list[int]:
    """Publish every payload to `topic` in one statement; return the new ids in order.

    `target` is an `Engine` (own transaction, committed here) or a `Connection`
    (written inside the caller's transaction: invisible until the caller
    commits, gone on rollback). `key`, `headers` and `delay` (seconds before
    the messages become claimable) apply to every message of the batch.

    Inside the caller's transaction, every group subscribed before this call
    gets its rows under READ COMMITTED (PostgreSQL's default). Under REPEATABLE
    READ or SERIALIZABLE the whole transaction reads one snapshot, so a group
    subscribed after that snapshot was taken gets no row for these messages.
    """
    check_name("topic", topic)
    batch = payloads if isinstance(payloads, list) else list(payloads)
    if not batch:
        return []
    if delay is not None and delay < 0:
        raise UsageError("delay must be >= 0")
    if key is not None:
        _check_key(key)
    params = {
        "topic": topic,
        "payloads": to_json(batch),
        "key": key,
        "headers": to_json(dict(headers)) if headers is not None else None,
        "delay": dt.timedelta(seconds=delay or 0.0),
        "channel": q.notify_channel(schema_of(target)),
    }
    try:
        with wrap_errors(), _transaction(target) as conn:
            ids = _locked_publish(conn, params)
    except PermissionDenied:
        if isinstance(target, Engine):  # a caller's transaction is aborted: nothing to ask
            with wrap_errors(), target.connect() as conn:
                require_privileges(conn, "producer")  # names every privilege missing
        raise
    if ids is None:
        raise UnknownTopic(f"unknown topic {topic!r}")
    return list(ids)


class _AbortedPipelineNoise(logging.Filter):
    """Drops psycopg's `error ignored terminating <Pipeline>` warning: when a statement
    in the publish pipeline fails (a refused lock, say), the pipeline's exit fails in
    turn and psycopg logs that second error; the first one is what the caller gets.
    Without this, the CLI's one error line came with a second (Python's last-resort
    handler prints warnings of loggers nobody configured)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            isinstance(record.msg, str)
            and record.msg.startswith("error ignored terminating")
            and "Pipeline" in record.getMessage()
        )


logging.getLogger("psycopg").addFilter(_AbortedPipelineNoise())


def _check_key(key: object) -> None:
    """A key is text PostgreSQL can store: UTF-8 without NUL (`InvalidPayload` else)."""
    if not isinstance(key, str):
        raise InvalidPayload(f"key must be a string, not {type(key).__name__}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPayload("key is not valid text (a lone surrogate)") from None
    if "\x00" in key:
        raise InvalidPayload("key cannot contain a NUL character")


def _locked_publish(conn: Connection, params: dict[str, Any]) -> list[int] | None:
    """Lock the topic, then publish: two statements, sent together.

    Two statements because the insert must take its snapshot after the topic
    lock is granted (see `q.lock_topic_for_publish`; on Citus the lock is the
    coordinator's advisory lock on the topic, shared, as
    `pgq.sql.locks.topic_key` says); sent together because
    psycopg's pipeline writes both before it reads a result, so publishing
    costs the round trips it cost as one statement (measured with a protocol
    trace: BEGIN, the pair, COMMIT). Runs in the connection's transaction.
    """
    if placement.distributed(conn):
        lock_sql, lock_defaults = driver_sql(conn, topic_lock(shared=True))
        lock_params = {**lock_defaults, "key": topic_key(schema_of(conn), params["topic"])}
    else:
        lock_sql, lock_defaults = driver_sql(conn, q.lock_topic_for_publish())
        lock_params = {**lock_defaults, "topic": params["topic"]}
    sql, defaults = driver_sql(conn, q.publish_batch())
    if not conn.in_transaction():
        conn.begin()  # what SQLAlchemy's autobegin would do: the caller's commit() ends it
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as lock, driver.cursor() as cur:
        with driver.pipeline() if psycopg.Pipeline.is_supported() else contextlib.nullcontext():
            lock.execute(lock_sql, lock_params)
            cur.execute(sql, {**defaults, **params})
        row = cur.fetchone()  # after the pipeline's sync: both results are in
    return None if row is None or row[0] is None else list(row[0])


def publish(
    target: Bind,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    delay: float | None = None,
) -> int:
    """Publish one message to `topic`; return its id. See `publish_many`."""
    return publish_many(target, topic, [payload], key=key, headers=headers, delay=delay)[0]
