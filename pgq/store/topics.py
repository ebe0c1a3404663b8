"""Topics, groups and publishing: `create_topic`, `subscribe`, `publish`, `publish_many`."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.sql import Executable

from pgq.errors import (
    InvalidPayload,
    PermissionDenied,
    TransactionConflict,
    UnknownGroup,
    UnknownTopic,
    UsageError,
)
from pgq.names import check_name
from pgq.otel import tracing as otel
from pgq.records import GroupInfo
from pgq.sql import frontier as frontier_sql
from pgq.sql import publish as q
from pgq.sql.locks import topic_key, topic_lock
from pgq.store import placement
from pgq.store.connections import driver_sql
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.placement import Spanning, spanning
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
    target: Bind,
    group: str,
    topic: str,
    start: Literal["earliest", "latest"] = "earliest",
    *,
    ordered: bool = False,
) -> None:
    """Create consumer group `group` on `topic` (idempotent).

    With `start="earliest"` the group gets a delivery row for every retained
    message of the topic; with `"latest"` only messages published after this
    call commits. Waits for publishing transactions that are still open, so no
    message is left without the new group's row. An `ordered` group handles the
    messages of each non-null key one at a time, in frontier order (DESIGN §7);
    whether a group is ordered is fixed when it is created.
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
        params = {"name": group, "topic_id": topic_id, "start": start, "ordered": ordered}
        group_id = conn.execute(q.insert_group(), params).scalar()
        if group_id is None:
            existing = conn.execute(q.group_by_name(), {"name": group}).one()
            if existing.topic != topic:
                raise UsageError(
                    f"group {group!r} already exists on topic {existing.topic!r}, not {topic!r}"
                )
            if existing.ordered != ordered:
                kind = "ordered" if existing.ordered else "not ordered"
                raise UsageError(
                    f"group {group!r} already exists and is {kind}: whether a group is"
                    " ordered is fixed when it is created"
                )
            return
        conn.execute(q.insert_group_state(), {"gid": group_id})
        # its frontier counts in the xids of the server that holds its rows (decision
        # 0047); a routed statement, so that on Citus that is the group's node
        conn.execute(frontier_sql.name_xid_space(), {"gid": group_id})
        conn.execute(q.insert_breaker(), {"gid": group_id})
        if start == "earliest":
            with spanning(conn, Spanning.SUBSCRIBE_BACKFILL):
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
    dedupe_keys: Sequence[str | None] | None = None,
) -> list[int]:
    """Publish every payload to `topic` in one statement; return the ids in order.

    `target` is an `Engine` (own transaction, committed here) or a `Connection`
    (written inside the caller's transaction: invisible until the caller
    commits, gone on rollback). `key`, `headers` and `delay` (seconds before
    the messages become claimable) apply to every message of the batch.

    `dedupe_keys` (as many as payloads; None for a payload without one) makes
    publishing idempotent: while a message of the topic with the same dedupe key
    is retained, its payload is not inserted and its position gets that
    message's id (the new payload, key, headers and delay are dropped, not
    compared). Publishers of one key at once, in transactions that commit in any
    order, end with one message: the second waits for the first's transaction,
    and gets its id if it commits, or inserts if it rolls back. Repeats of a key
    within one call are one message. Once retention has deleted the message, the
    key publishes a new one. Under REPEATABLE READ or SERIALIZABLE a key that
    another transaction published after the caller's snapshot raises
    `TransactionConflict` (retry the transaction). Decision 0040.

    Inside the caller's transaction, every group subscribed before this call
    gets its rows under READ COMMITTED (PostgreSQL's default). Under REPEATABLE
    READ or SERIALIZABLE the whole transaction reads one snapshot, so a group
    subscribed after that snapshot was taken gets no row for these messages.
    """
    check_name("topic", topic)
    batch = payloads if isinstance(payloads, list) else list(payloads)
    keys = _dedupe_keys(dedupe_keys, len(batch))
    if not batch:
        return []
    if delay is not None and delay < 0:
        raise UsageError("delay must be >= 0")
    if key is not None:
        _check_key(key)
    if otel.TRACING:  # the `otel` extra: a PRODUCER span and its context in the headers
        return otel.publish_traced(
            topic,
            len(batch),
            headers,
            lambda traced: _publish(target, topic, batch, keys, key, traced, delay),
        )
    return _publish(target, topic, batch, keys, key, headers, delay)


def _publish(
    target: Bind,
    topic: str,
    batch: list[Any],
    keys: list[str | None] | None,
    key: str | None,
    headers: Mapping[str, Any] | None,
    delay: float | None,
) -> list[int]:
    """`publish_many`'s statements, its arguments checked."""
    params = {
        "topic": topic,
        "key": key,
        "headers": to_json(dict(headers)) if headers is not None else None,
        "delay": dt.timedelta(seconds=delay or 0.0),
        "channel": q.notify_channel(schema_of(target)),
    }
    try:
        with wrap_errors(), _transaction(target) as conn:
            if keys is None:
                params["payloads"] = to_json(batch)
                row = _locked_publish(conn, q.publish_batch(), params)
                ids = None if row is None or row[0] is None else list(row[0])
            else:
                ids = _deduped_publish(conn, params, batch, keys)
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
    _check_text("key", key)


def _check_text(what: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPayload(f"{what} is not valid text (a lone surrogate)") from None
    if "\x00" in value:
        raise InvalidPayload(f"{what} cannot contain a NUL character")


def _dedupe_keys(keys: Sequence[str | None] | None, n: int) -> list[str | None] | None:
    """`dedupe_keys` checked: as many as payloads, each None or a valid key; None when
    no payload has one (such a batch is published as one without keys)."""
    if keys is None:
        return None
    # an ordered sequence only: a set or a dict would pair keys with payloads in
    # hash order
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise UsageError(
            f"dedupe_keys must be a list with one key (or None) per payload,"
            f" not {type(keys).__name__}"
        )
    listed = list(keys)
    if len(listed) != n:
        raise UsageError(f"dedupe_keys has {len(listed)} entries for {n} payloads")
    for k in listed:
        if k is not None:
            check_dedupe_key(k)
    return listed if any(k is not None for k in listed) else None


def check_dedupe_key(key: object) -> str:
    """A dedupe key is 1-`DEDUPE_KEY_MAX` characters of text PostgreSQL can store
    (`InvalidPayload` else): one index entry must hold it."""
    if not isinstance(key, str):
        raise InvalidPayload(f"dedupe key must be a string, not {type(key).__name__}")
    if not 0 < len(key) <= DEDUPE_KEY_MAX:
        raise InvalidPayload(f"dedupe key must be 1-{DEDUPE_KEY_MAX} characters, not {len(key)}")
    _check_text("dedupe key", key)
    return key


DEDUPE_KEY_MAX = 512
"""The longest dedupe key, in characters (at most 2 KiB of UTF-8: a B-tree entry
holds some 2.7 KiB)."""

_DEDUPE_ROUNDS = 5
"""How often a publish inserts again a key whose message retention deleted between
its insert and its lookup (one more round each time: in practice never)."""


def _deduped_publish(
    conn: Connection, params: dict[str, Any], batch: list[Any], keys: list[str | None]
) -> list[int] | None:
    """Publish `batch` with its dedupe `keys` (`q.publish_batch_deduped`); the id of
    each position, or None when the topic does not exist.

    A key repeated in the batch is sent once, at its first position. A key that
    was not inserted belongs to a message that exists: `q.dedupe_lookup`, a later
    statement, reads its id (its snapshot sees what the insert waited for). A key
    found in neither (retention deleted its message in between) is sent again.
    """
    first: dict[str, int] = {}
    pending = [i for i, k in enumerate(keys) if k is None or first.setdefault(k, i) == i]
    found: dict[str, int] = {}
    plain: list[int] = []  # the ids of the payloads without a key, in order
    topic_id = None
    for _ in range(_DEDUPE_ROUNDS):
        sent = {
            **params,
            "payloads": to_json([batch[i] for i in pending]),
            "dedupe_keys": to_json([keys[i] for i in pending]),
        }
        row = _locked_publish(conn, q.publish_batch_deduped(), sent)
        if row is None:
            return None
        ids, inserted_keys, topic_id = row[0] or [], row[1] or [], row[2]
        for mid, k in zip(ids, inserted_keys, strict=True):
            if k is None:
                plain.append(mid)
            else:
                found[k] = mid
        missing = [k for i in pending if (k := keys[i]) is not None and k not in found]
        if missing:
            lookup = conn.execute(q.dedupe_lookup(), {"topic_id": topic_id, "keys": missing})
            found.update({k: int(mid) for k, mid in lookup})
        pending = [i for i in pending if (k := keys[i]) is not None and k not in found]
        if not pending:
            break
    else:
        raise TransactionConflict(
            f"dedupe keys published and deleted again {_DEDUPE_ROUNDS} times: try again"
        )
    plain_ids = iter(plain)
    return [next(plain_ids) if k is None else found[k] for k in keys]


def _locked_publish(
    conn: Connection, statement: Executable, params: dict[str, Any]
) -> tuple[Any, ...] | None:
    """Lock the topic, then publish: two statements, sent together.

    Two statements because the insert must take its snapshot after the topic
    lock is granted (see `q.lock_topic_for_publish`; on Citus the lock is the
    coordinator's advisory lock on the topic, shared, as
    `pgq.sql.locks.topic_key` says); sent together because
    psycopg's pipeline writes both before it reads a result, so publishing
    costs the round trips it cost as one statement (measured with a protocol
    trace: BEGIN, the pair, COMMIT). Runs in the connection's transaction;
    returns `statement`'s one row (None without one).
    """
    if placement.distributed(conn):
        lock_sql, lock_defaults = driver_sql(conn, topic_lock(shared=True))
        lock_params = {**lock_defaults, "key": topic_key(schema_of(conn), params["topic"])}
    else:
        lock_sql, lock_defaults = driver_sql(conn, q.lock_topic_for_publish())
        lock_params = {**lock_defaults, "topic": params["topic"]}
    sql, defaults = driver_sql(conn, statement)
    if not conn.in_transaction():
        conn.begin()  # what SQLAlchemy's autobegin would do: the caller's commit() ends it
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as lock, driver.cursor() as cur:
        with driver.pipeline() if psycopg.Pipeline.is_supported() else contextlib.nullcontext():
            lock.execute(lock_sql, lock_params)
            cur.execute(sql, {**defaults, **params})
        row = cur.fetchone()  # after the pipeline's sync: both results are in
    return None if row is None else tuple(row)


def publish(
    target: Bind,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    delay: float | None = None,
    dedupe_key: str | None = None,
) -> int:
    """Publish one message to `topic`; return its id. See `publish_many`.

    With `dedupe_key`: while a message of the topic with that key is retained
    (not yet deleted by retention), publishing again inserts nothing and returns
    that message's id; after retention deleted it, the key publishes a new one.
    """
    keys = None if dedupe_key is None else [dedupe_key]
    return publish_many(
        target, topic, [payload], key=key, headers=headers, delay=delay, dedupe_keys=keys
    )[0]
