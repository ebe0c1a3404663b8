"""Attacks on idempotent publish (decision 0040, schema version 7) against a real
server: races of keyed publishers in transactions, consumers, retention, hostile
keys, the upgrade from version 6 and the producer's privileges."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from fixtures.released import restore
from helpers import FAST, JOIN, OpenTransaction, blocked, invoke, open_transaction, wait_until
from psycopg import sql
from sqlalchemy import Connection, Engine, event, select

import pgq
from pgq import schema as t
from pgq.errors import DatabaseError, SchemaMissing, UsageError
from pgq.store import GroupStore
from pgq.store.migrations import LATEST
from pgq.store.topics import DEDUPE_KEY_MAX


def keyed(engine: Engine, topic: str = "orders") -> dict[str, list[int]]:
    """Dedupe key -> the ids of the topic's messages with it."""
    m, tp = t.message, t.topic
    query = (
        select(m.c.dedupe_key, m.c.id)
        .join(tp, tp.c.id == m.c.topic_id)
        .where(tp.c.name == topic, m.c.dedupe_key.is_not(None))
        .order_by(m.c.id)
    )
    out: dict[str, list[int]] = {}
    with engine.connect() as conn:
        for key, mid in conn.execute(query):
            out.setdefault(key, []).append(int(mid))
    return out


def returned(tx: OpenTransaction) -> Any:
    assert tx.done.wait(JOIN), f"{tx.name} did not return"
    assert tx.error is None, tx.error
    return tx.result


def many(topic: str, payloads: list[Any], keys: list[str | None]) -> Callable[[Connection], Any]:
    return lambda conn: pgq.publish_many(conn, topic, payloads, dedupe_keys=keys)


def one(topic: str, payload: Any, key: str) -> Callable[[Connection], Any]:
    return lambda conn: pgq.publish(conn, topic, payload, dedupe_key=key)


# --- races ---------------------------------------------------------------------------


def test_a_batch_repeating_keys_other_transactions_hold_gets_each_keys_one_id(orders):
    a = open_transaction(orders, one("orders", "a by A", "a"), "A")
    [id_a] = [returned(a)]
    b = open_transaction(orders, many("orders", ["b by B", "c by B"], ["b", "c"]), "B")
    id_b, _id_c = returned(b)
    keys = ["a", "x", "b", "a", None, "b", "c", "x"]
    c = open_transaction(orders, many("orders", [f"p{i}" for i in range(8)], keys), "C")
    blocked(orders, c)
    b.finish(rollback=True)  # b and c are C's now
    blocked(orders, c)  # still for A
    assert a.finish() == id_a
    ids = c.finish()
    assert ids[0] == ids[3] == id_a
    assert ids[1] == ids[7] and ids[2] == ids[5] and id_b not in ids
    found = keyed(orders)
    assert found == {"a": [id_a], "x": [ids[1]], "b": [ids[2]], "c": [ids[6]]}
    again = pgq.publish_many(orders, "orders", [0, 0, 0, 0], dedupe_keys=["c", "b", "x", "a"])
    assert again == [ids[6], ids[2], ids[1], id_a]


def test_the_same_key_on_two_topics_never_waits_for_the_other(orders):
    pgq.create_topic(orders, "refunds")
    a = open_transaction(orders, one("orders", 1, "k"), "on orders")
    returned(a)
    b = open_transaction(orders, one("refunds", 2, "k"), "on refunds")
    returned(b)  # not waiting for the orders transaction
    id_b = b.finish()
    id_a = a.finish()
    assert keyed(orders, "orders") == {"k": [id_a]}
    assert keyed(orders, "refunds") == {"k": [id_b]}


# --- retention -----------------------------------------------------------------------


def expire(conn: Connection, topic: str = "orders") -> int:
    """Retention with retention 0, as a member runs it, in `conn`'s transaction."""
    topic_id = int(conn.scalar(select(t.topic.c.id).where(t.topic.c.name == topic)))
    store = GroupStore(0, "-", topic, "retention", 30.0, 3)
    total = 0
    while deleted := store.expire_messages(conn, topic_id, 0.0):
        total += deleted
    return total


@pytest.fixture
def plain(engine: Engine) -> Engine:
    """Topic `plain` without a group: retention deletes every message of it."""
    pgq.create_topic(engine, "plain")
    return engine


@pytest.mark.parametrize("retention_ends", ["commits", "rolls back"])
def test_a_publisher_waiting_on_a_message_retention_deletes_gets_one_id(plain, retention_ends):
    first = pgq.publish(plain, "plain", "first", dedupe_key="k")
    retention = open_transaction(plain, lambda conn: expire(conn, "plain"), "retention")
    assert returned(retention) == 1
    publisher = open_transaction(plain, one("plain", "second", "k"), "publisher")
    blocked(plain, publisher)  # for retention's delete: it may yet roll back
    retention.finish(rollback=retention_ends == "rolls back")
    mid = publisher.finish()
    assert keyed(plain, "plain") == {"k": [mid]}
    assert (mid == first) == (retention_ends == "rolls back")
    assert pgq.publish(plain, "plain", "third", dedupe_key="k") == mid


def test_a_key_whose_message_retention_deletes_before_the_lookup_is_published_again(plain):
    first = pgq.publish(plain, "plain", "first", dedupe_key="k")
    deleted: list[int] = []

    def before(conn, cursor, statement, params, context, executemany):
        if "dedupe_key = ANY" in statement and not deleted:  # the lookup, once
            with plain.begin() as other:
                deleted.append(expire(other, "plain"))

    event.listen(plain, "before_cursor_execute", before)
    try:
        mid = pgq.publish(plain, "plain", "second", dedupe_key="k")
    finally:
        event.remove(plain, "before_cursor_execute", before)
    assert deleted == [1]
    assert mid != first
    assert keyed(plain, "plain") == {"k": [mid]}


def test_a_savepoint_rolled_back_frees_the_key_for_the_one_waiting(orders):
    waiters: list[OpenTransaction] = []

    def publish_then_undo(conn: Connection) -> int:
        savepoint = conn.begin_nested()
        mid = pgq.publish(conn, "orders", "undone", dedupe_key="k")
        waiters.append(open_transaction(orders, one("orders", "kept", "k"), "waiter"))
        blocked(orders, waiters[0])
        savepoint.rollback()
        return mid

    outer = open_transaction(orders, publish_then_undo, "outer")
    undone = returned(outer)
    kept = returned(waiters[0])  # the savepoint's rollback freed the key: no wait for `outer`
    assert kept != undone
    waiters[0].finish()
    outer.finish()
    assert keyed(orders) == {"k": [kept]}


# --- consumers -----------------------------------------------------------------------


def test_a_consumer_draining_while_keyed_publishers_race_gets_each_message_once(orders):
    """Four threads publish 30 rounds of the same 10 keys (a batch, some in their own
    transaction that rolls back, some one by one), while a member of `billing` drains;
    a group subscribed `earliest` afterwards gets every retained message too. Each
    group handles each message of each key once, and nothing else."""
    handled: dict[str, list[int]] = {"billing": [], "late": []}
    lock = threading.Lock()

    def handler(group: str) -> Callable[[Any], None]:
        def handle(msg: Any) -> None:
            with lock:
                handled[group].append(msg.id)

        return handle

    member = pgq.Consumer(orders, "billing", handler("billing"), **FAST)
    member.start()
    barrier = threading.Barrier(4)
    told: dict[str, set[int]] = {}
    errors: list[BaseException] = []

    def publisher(n: int) -> None:
        try:
            for r in range(30):
                keys = [f"r{r}k{i}" for i in range(10)]
                barrier.wait(JOIN)
                with orders.connect() as conn, conn.begin() as tx:
                    if n % 2:
                        ids = pgq.publish_many(conn, "orders", keys, dedupe_keys=keys)
                    else:
                        ids = [pgq.publish(conn, "orders", k, dedupe_key=k) for k in keys]
                    if (n + r) % 4 == 0:
                        tx.rollback()
                        continue
                with lock:
                    for k, mid in zip(keys, ids, strict=True):
                        told.setdefault(k, set()).add(mid)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=publisher, args=(n,), daemon=True) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(JOIN * 2)
    assert not any(th.is_alive() for th in threads) and not errors, errors
    found = keyed(orders)
    assert set(found) == set(told) and len(found) == 300
    assert all(len(ids) == 1 and told[k] == set(ids) for k, ids in found.items())
    wait_until(lambda: len(handled["billing"]) >= 300, JOIN, "billing to drain")
    member.stop(timeout=JOIN)
    pgq.subscribe(orders, "late", "orders", start="earliest")
    pgq.Consumer(orders, "late", handler("late"), **FAST).run(until_empty=True)
    every = sorted(ids[0] for ids in found.values())
    assert sorted(handled["billing"]) == every
    assert sorted(handled["late"]) == every


def test_a_subscribe_while_a_keyed_publisher_waits_gives_the_group_each_message_once(orders):
    holder = open_transaction(orders, one("orders", "held", "k"), "holder")
    returned(holder)
    waiter = open_transaction(orders, one("orders", "waits", "k"), "waiter")
    blocked(orders, waiter)
    late = open_transaction(orders, lambda conn: pgq.subscribe(conn, "late", "orders"), "subscribe")
    blocked(orders, late)  # for both publishers' topic lock
    mid = holder.finish()
    assert waiter.finish() == mid
    late.finish()
    assert pgq.status(orders, "late")["counts"]["ready"] == 1
    assert pgq.status(orders, "billing")["counts"]["ready"] == 1


# --- hostile keys --------------------------------------------------------------------


def test_the_longest_key_of_four_byte_characters_fits_the_index(orders):
    longest = "".join(chr(0x10000 + (i * 7919) % 0xFFFFF) for i in range(DEDUPE_KEY_MAX))
    assert len(longest.encode()) == 4 * DEDUPE_KEY_MAX  # 2 KiB, nothing to compress
    mid = pgq.publish(orders, "orders", 1, dedupe_key=longest)
    assert pgq.publish_many(orders, "orders", [2, 3], dedupe_keys=[longest, longest]) == [mid, mid]


@pytest.mark.parametrize("unordered", [{"a", "b"}, {"a": 1, "b": 2}], ids=["set", "dict"])
def test_dedupe_keys_in_an_unordered_collection_are_refused(orders, unordered):
    """Keys are paired with payloads by position: a set pairs them in hash order
    (which payload gets "a" differs between runs), and a dict's keys are a
    mistake of the same kind. Both were accepted; the error says "a list"."""
    with pytest.raises(UsageError, match="dedupe_keys must be a list"):
        pgq.publish_many(orders, "orders", ["for a", "for b"], dedupe_keys=unordered)
    assert keyed(orders) == {}


# --- the upgrade ---------------------------------------------------------------------


@pytest.fixture
def v6(pg_dsn: str, schema: str) -> Iterator[Engine]:
    """The test's schema as version 6 released it, with group `g` on topic `t` and
    messages in it (written with that version's statements: today's need today's
    schema)."""
    restore(pg_dsn, schema, 6)
    s = sql.Identifier(schema).as_string(None)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {s}.topic (name) VALUES ('t')")
        gid = conn.execute(
            f"INSERT INTO {s}.consumer_group (name, topic_id, start)"
            f" SELECT 'g', id, 'earliest' FROM {s}.topic RETURNING id"
        ).fetchone()
        for table in ("breaker", "group_state"):
            conn.execute(f"INSERT INTO {s}.{table} (group_id) VALUES (%s)", gid)
        conn.execute(
            f"WITH m AS (INSERT INTO {s}.message (topic_id, payload)"
            f" SELECT tp.id, to_jsonb(i) FROM {s}.topic tp, generate_series(0, 499) i"
            f" RETURNING id) INSERT INTO {s}.delivery (group_id, message_id)"
            " SELECT %s, id FROM m",
            gid,
        )
    eng = pgq.connect(pg_dsn, schema=schema)
    yield eng
    eng.dispose()


def test_a_v6_database_upgraded_while_keyed_publishers_run_keeps_one_message_per_key(v6):
    stop = threading.Event()
    told: dict[str, set[int]] = {}
    errors: list[str] = []
    upgraded = threading.Event()

    def publisher(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                pgq.publish(v6, "t", {"plain": n})
                key = f"k{i % 20}"
                mid = pgq.publish(v6, "t", {"by": n}, dedupe_key=key)
            except (DatabaseError, SchemaMissing) as exc:  # before the upgrade: run pgq init
                if upgraded.is_set():
                    errors.append(str(exc))
                continue
            told.setdefault(key, set()).add(mid)

    threads = [threading.Thread(target=publisher, args=(n,), daemon=True) for n in range(3)]
    for th in threads:
        th.start()
    assert pgq.migrate(v6) == LATEST
    upgraded.set()
    wait_until(lambda: len(told) == 20, JOIN, "every key published after the upgrade")
    stop.set()
    for th in threads:
        th.join(JOIN)
    assert not errors, errors[:3]
    found = keyed(v6, "t")
    assert {k: set(ids) for k, ids in found.items()} == told
    assert all(len(ids) == 1 for ids in found.values())


def test_a_keyed_publish_before_the_upgrade_says_to_run_pgq_init(v6, pgq_env):
    """New code on a version 6 schema (the code deployed before `pgq init`): a keyed
    publish failed with `DatabaseError` "column "dedupe_key" of relation "message"
    does not exist", and `pgq publish --dedupe-key` exited 1, the code of an internal
    error. The schema is too old, as it is missing when not installed: a usage error
    (exit 2) that says `pgq init`, like `SchemaMissing`."""
    with pytest.raises(UsageError, match="pgq init"):
        pgq.publish(v6, "t", 1, dedupe_key="k")
    result = invoke(pgq_env, "publish", "t", "{}", "--dedupe-key", "k")
    assert result.exit_code == 2, result.output
    assert "pgq init" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "index",
    [
        "CREATE INDEX CONCURRENTLY message_dedupe_key_idx ON {s}.message"
        " (topic_id, dedupe_key) WHERE dedupe_key IS NOT NULL",
        "CREATE UNIQUE INDEX CONCURRENTLY message_dedupe_key_idx ON {s}.message (dedupe_key)",
    ],
    ids=["not unique", "without the topic"],
)
def test_migration_7_keeps_an_index_of_its_name_only_if_it_is_the_declared_one(
    pg_dsn, schema, index
):
    """docs/operations.md has the operator build the index beforehand, CONCURRENTLY,
    under its name; migration 7 keeps any valid index of that name. One built wrong
    (UNIQUE left out, the topic left out) was kept, version 7 recorded, and from then
    on every keyed publish failed: "there is no unique or exclusion constraint
    matching the ON CONFLICT specification". The migration must build the declared
    index (or refuse, naming it), never leave keyed publishing broken."""
    restore(pg_dsn, schema, 6)
    s = sql.Identifier(schema).as_string(None)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {s}.message ADD COLUMN IF NOT EXISTS dedupe_key text")
        conn.execute(index.format(s=s))
    eng = pgq.connect(pg_dsn, schema=schema)
    try:
        try:
            pgq.migrate(eng)
        except UsageError as exc:
            assert "message_dedupe_key_idx" in str(exc)
            return
        pgq.create_topic(eng, "t")
        pgq.create_topic(eng, "u")
        first = pgq.publish(eng, "t", 1, dedupe_key="k")
        assert pgq.publish(eng, "t", 2, dedupe_key="k") == first
        assert pgq.publish(eng, "u", 3, dedupe_key="k") != first
    finally:
        eng.dispose()
