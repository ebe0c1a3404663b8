"""Idempotent publish (`dedupe_key`, schema version 7, decision 0040) against a real
server: one message per (topic, key) while it is retained, whoever publishes it,
in whatever transactions, threads and processes; a new one once retention
deleted it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST, JOIN, across_groups, blocked, open_transaction
from sqlalchemy import Connection, Engine, func, select, text

import pgq
from pgq import schema as t
from pgq.errors import InvalidPayload, TransactionConflict, UnknownTopic, UsageError
from pgq.store import GroupStore
from pgq.store.topics import DEDUPE_KEY_MAX


def messages(engine: Engine, dedupe_key: str | None = None) -> list[tuple[int, Any]]:
    """(id, payload) of the messages (with `dedupe_key`, when given), in id order."""
    m = t.message
    query = select(m.c.id, m.c.payload).order_by(m.c.id)
    if dedupe_key is not None:
        query = query.where(m.c.dedupe_key == dedupe_key)
    with across_groups(engine) as conn:  # every topic's
        return [tuple(row) for row in conn.execute(query)]


def delivery_rows(engine: Engine) -> dict[int, int]:
    """Message id -> how many delivery rows it has."""
    d = t.delivery
    with across_groups(engine) as conn:  # every group's
        rows = conn.execute(select(d.c.message_id, func.count()).group_by(d.c.message_id))
        return {int(mid): int(n) for mid, n in rows}


# --- one publisher ----------------------------------------------------------------


def test_a_key_published_again_returns_the_first_id_and_inserts_nothing(orders):
    first = pgq.publish(orders, "orders", {"n": 1}, dedupe_key="order-17")
    again = pgq.publish(orders, "orders", {"n": 2}, key="other", dedupe_key="order-17")
    assert again == first
    assert messages(orders) == [(first, {"n": 1})]  # the second payload is dropped
    assert delivery_rows(orders) == {first: 1}
    # another topic has keys of its own; no key is never a duplicate
    pgq.create_topic(orders, "refunds")
    elsewhere = pgq.publish(orders, "refunds", {"n": 3}, dedupe_key="order-17")
    plain = [pgq.publish(orders, "orders", {"n": 4}) for _ in range(2)]
    assert len({first, elsewhere, *plain}) == 4
    assert pgq.status(orders, "billing")["counts"]["ready"] == 3


def test_publish_many_folds_repeated_keys_and_answers_every_position(orders):
    old = pgq.publish(orders, "orders", "old", dedupe_key="a")
    keys = ["a", None, "b", "b", "c", None, "c", "a"]
    ids = pgq.publish_many(orders, "orders", [f"p{i}" for i in range(8)], dedupe_keys=keys)
    assert ids[0] == ids[7] == old
    assert ids[2] == ids[3] and ids[4] == ids[6]
    new = [ids[1], ids[2], ids[4], ids[5]]
    assert new == sorted(new) and old < new[0]  # inserted in input order
    assert messages(orders) == [(old, "old"), *zip(new, ["p1", "p2", "p4", "p5"], strict=True)]
    assert delivery_rows(orders) == dict.fromkeys([old, *new], 1)
    # every key there already: nothing inserted, no row, the ids all the same
    assert pgq.publish_many(orders, "orders", [1, 2], dedupe_keys=["c", "b"]) == [ids[4], ids[2]]
    # keys all None: a publish without keys
    assert len(set(pgq.publish_many(orders, "orders", [1, 2], dedupe_keys=[None, None]))) == 2
    assert len(messages(orders)) == 7


def test_a_key_published_twice_in_one_transaction_is_one_message(orders):
    with orders.begin() as conn:
        first = pgq.publish(conn, "orders", 1, dedupe_key="k")
        assert pgq.publish(conn, "orders", 2, dedupe_key="k") == first
        k, j = pgq.publish_many(conn, "orders", [3, 4], dedupe_keys=["k", "j"])
    assert k == first
    assert messages(orders) == [(first, 1), (j, 4)]  # (a duplicate still draws an id)


@pytest.mark.parametrize(
    ("keys", "error", "says"),
    [
        ("ab", UsageError, "dedupe_keys must be a list"),
        (7, UsageError, "dedupe_keys must be a list"),
        (["a"], UsageError, "dedupe_keys has 1 entries for 2 payloads"),
        (["a", 7], InvalidPayload, "dedupe key must be a string, not int"),
        (["a", b"b"], InvalidPayload, "dedupe key must be a string, not bytes"),
        (["a", ""], InvalidPayload, f"dedupe key must be 1-{DEDUPE_KEY_MAX} characters"),
        (["a", "x" * (DEDUPE_KEY_MAX + 1)], InvalidPayload, "characters, not 513"),
        (["a", "b\x00"], InvalidPayload, "dedupe key cannot contain a NUL character"),
        (["a", "\udcff"], InvalidPayload, "dedupe key is not valid text"),
    ],
)
def test_a_bad_dedupe_key_is_refused_and_nothing_is_published(orders, keys, error, says):
    with pytest.raises(error, match=says):
        pgq.publish_many(orders, "orders", [1, 2], dedupe_keys=keys)
    assert messages(orders) == []


def test_the_longest_key_and_any_text_are_keys(orders):
    longest = "é" * DEDUPE_KEY_MAX  # 1 KiB of UTF-8: fits one index entry
    odd = "line\nbreak\x1b[31m<b>"
    ids = [pgq.publish(orders, "orders", i, dedupe_key=k) for i, k in enumerate([longest, odd])]
    assert [pgq.publish(orders, "orders", 9, dedupe_key=k) for k in (longest, odd)] == ids
    with pytest.raises(UnknownTopic):
        pgq.publish(orders, "nowhere", 1, dedupe_key="k")


# --- publishers at once: transactions ----------------------------------------------


def published(dedupe_keys: list[str]) -> Callable[[Connection], list[int]]:
    def run(conn: Connection) -> list[int]:
        return pgq.publish_many(conn, "orders", dedupe_keys, dedupe_keys=dedupe_keys)

    return run


def test_a_publisher_whose_transaction_rolls_back_leaves_the_key_to_the_one_waiting(orders):
    first = open_transaction(orders, published(["k"]), "first")
    assert first.done.wait(JOIN)
    second = open_transaction(orders, published(["k"]), "second")
    blocked(orders, second)  # for the first's transaction: its message may yet commit
    [lost] = first.finish(rollback=True)
    [kept] = second.finish()
    assert kept != lost
    assert messages(orders) == [(kept, "k")]
    assert delivery_rows(orders) == {kept: 1}


def test_publishers_committing_out_of_order_end_with_one_message_per_key(orders):
    """A publishes `a` and stays open; B publishes `b` and stays open; C publishes
    [b, a] and waits for B, then for A; B commits before A, which began first. C gets
    each key's first id and inserts nothing; D, after everyone, gets them too."""
    a = open_transaction(orders, published(["a"]), "a")
    assert a.done.wait(JOIN)
    b = open_transaction(orders, published(["b"]), "b")
    assert b.done.wait(JOIN)
    c = open_transaction(orders, published(["b", "a"]), "c")
    blocked(orders, c)
    [id_b] = b.finish()
    blocked(orders, c)  # now for A
    [id_a] = a.finish()
    assert c.finish() == [id_b, id_a]
    assert pgq.publish_many(orders, "orders", [1, 2], dedupe_keys=["a", "b"]) == [id_a, id_b]
    assert messages(orders) == [(id_a, "a"), (id_b, "b")]
    assert delivery_rows(orders) == {id_a: 1, id_b: 1}


def test_under_repeatable_read_a_key_published_after_the_snapshot_is_a_conflict(orders):
    with orders.connect() as conn:
        conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        conn.execute(text("SELECT 1"))  # the snapshot
        other = pgq.publish(orders, "orders", "other", dedupe_key="k")
        with pytest.raises(TransactionConflict):
            pgq.publish(conn, "orders", "mine", dedupe_key="k")
        conn.rollback()
    assert messages(orders) == [(other, "other")]


# --- publishers at once: threads and processes ---------------------------------------


def test_threads_publishing_the_same_keys_at_once_end_with_one_message_per_key(orders):
    """Eight threads, each its own transaction per round, publish the same key at once
    (a barrier), 30 rounds; one in three rolls back. Every thread that committed
    answers the same id for the key; the key has one message, with one row."""
    threads, rounds = 8, 30
    barrier = threading.Barrier(threads)
    answers: dict[int, list[tuple[int, bool]]] = {r: [] for r in range(rounds)}
    errors: list[BaseException] = []

    def publisher(n: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(JOIN)
                with orders.connect() as conn, conn.begin() as tx:
                    mid = pgq.publish(conn, "orders", {"by": n}, dedupe_key=f"k{r}")
                    commit = (n + r) % 3 != 0
                    if not commit:
                        tx.rollback()
                answers[r].append((mid, commit))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    workers = [threading.Thread(target=publisher, args=(n,), daemon=True) for n in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(JOIN * 2)
    assert not any(w.is_alive() for w in workers) and not errors, errors
    rows = delivery_rows(orders)
    for r in range(rounds):
        [(mid, _)] = messages(orders, f"k{r}")
        assert {m for m, committed in answers[r] if committed} == {mid}, answers[r]
        assert rows[mid] == 1
    assert len(messages(orders)) == rounds


PUBLISHER = r"""
import json, random, sys
import pgq
dsn, schema, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = pgq.connect(dsn, schema=schema)
engine.connect().close()
keys = [f"k{i}" for i in range(40)]
random.Random(seed).shuffle(keys)
batch = [f"b{i:02}" for i in range(40)]
print("ready", flush=True)
sys.stdin.readline()
# one batch with every process's keys (in one order: batches with shared keys in
# different orders can deadlock, as with any unique index), then key by key
keyed = batch + batch[:3]
many = pgq.publish_many(engine, "orders", [*keyed, "plain"], dedupe_keys=[*keyed, None])
single = {k: pgq.publish(engine, "orders", {"by": seed}, dedupe_key=k) for k in keys}
print(json.dumps({"many": many, "single": single}), flush=True)
"""


def test_processes_publishing_the_same_keys_at_once_end_with_one_message_per_key(
    orders, pg_dsn: str, schema: str, procs: list[subprocess.Popen[str]]
):
    """Four processes publish the same 40 keys in one batch each (all at once), then
    the same 40 other keys one transaction each, each process in its own order."""
    env = {**os.environ, "PYTHONPATH": str(Path(pgq.__file__).parent.parent)}
    for seed in range(4):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-W", "error", "-c", PUBLISHER, pg_dsn, schema, str(seed)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:  # as close to at once as pipes go
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=JOIN * 2)
        assert proc.returncode == 0, out
        results.append(json.loads(out))
    first = results[0]
    for other in results[1:]:
        assert other["many"][:43] == first["many"][:43]
        assert other["single"] == first["single"]
    ids = {*first["many"][:40], *first["single"].values()}
    keys = [*first["single"], *(f"b{i:02}" for i in range(40))]
    keyed = [m for k in keys for m in messages(orders, k)]
    assert sorted(mid for mid, _ in keyed) == sorted(ids) and len(ids) == 80
    unkeyed = {r["many"][43] for r in results}
    assert len(unkeyed) == 4  # a payload without a key is never a duplicate
    assert len(messages(orders)) == 84
    assert delivery_rows(orders) == dict.fromkeys(ids | unkeyed, 1)


# --- retention ---------------------------------------------------------------------


def expire_all(engine: Engine) -> int:
    """Retention with retention 0, as a member runs it, until nothing is left to delete."""
    with engine.connect() as conn:
        topic_id = int(conn.scalar(select(t.topic.c.id).where(t.topic.c.name == "orders")))
    store = GroupStore(0, "-", "orders", "retention", 30.0, 3)
    total = 0
    with engine.begin() as conn:
        while deleted := store.expire_messages(conn, topic_id, 0.0):
            total += deleted
    return total


def test_a_finished_message_still_retained_holds_its_key_and_retention_frees_it(orders):
    handled: list[Any] = []

    def drain() -> int:
        summary = pgq.Consumer(orders, "billing", lambda m: handled.append(m.payload), **FAST).run(
            until_empty=True
        )
        return summary.done

    first = pgq.publish(orders, "orders", "first", dedupe_key="k")
    assert drain() == 1
    # done but retained: the key still answers the first id, nothing runs again
    assert pgq.publish(orders, "orders", "again", dedupe_key="k") == first
    assert drain() == 0
    assert expire_all(orders) == 1
    # retention deleted it: the key publishes a new message, delivered as any
    second = pgq.publish(orders, "orders", "after retention", dedupe_key="k")
    assert second > first
    assert messages(orders) == [(second, "after retention")]
    assert drain() == 1
    assert handled == ["first", "after retention"]
