"""Attacks on transactional handlers (decision 0042) from inside the handler: what a
handler does with `conn` (ends pgq's transaction behind SQLAlchemy's back, breaks the
connection, leaves a savepoint open, swallows a database error) and a failure at the
COMMIT.

The effect table has no unique key: a duplicate effect is a second row. At the end
of each test every message's effect row exists exactly once, the group's done count
equals the messages, and nothing is lost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from helpers import FAST, rows
from sqlalchemy import Connection, Engine, text

import pgq

WAIT = 30.0


@pytest.fixture
def effects(orders: Engine, schema: str) -> str:
    """A table of the handler's effects in the test's schema; its quoted name."""
    table = f'"{schema}".effects'
    with orders.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (message_id bigint, attempt int)"))
    return table


def effect_counts(engine: Engine, table: str) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.execute(text(f"SELECT message_id FROM {table}")))


def write_effect(table: str, message: pgq.Message, conn: Connection) -> None:
    conn.execute(
        text(f"INSERT INTO {table} VALUES (:id, :attempt)"),
        {"id": message.id, "attempt": message.attempt},
    )


def done_count(engine: Engine) -> int:
    return int(pgq.status(engine, "billing")["counts"]["done"])


@pytest.mark.parametrize("how", ["sql_commit", "dbapi_commit"])
def test_a_handler_that_commits_behind_sqlalchemys_back_leaves_nothing(orders, effects, how):
    """`conn.commit()` is refused, but a COMMIT sent as SQL (or on the DBAPI connection
    under `conn`) reaches the server: the effect becomes durable without its ack, and
    when the handler then fails the message runs again and writes it a second time.
    Nothing of a failed attempt may stay; the attempt must fail with a clear error."""
    mid = pgq.publish(orders, "orders", {"n": 1})

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if how == "sql_commit":
            conn.execute(text("COMMIT"))
        else:
            conn.connection.commit()
        if message.attempt == 1:
            raise ValueError("after committing")

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, max_attempts=2, **FAST)
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=WAIT)
    found = effect_counts(orders, effects)
    assert found[mid] <= 1, (found, summary)  # before: 2 (attempt 1's effect committed)
    assert summary.done + summary.dead == 1, summary


@pytest.mark.parametrize("how", ["sql_rollback", "dbapi_rollback"])
def test_a_handler_that_rolls_back_behind_sqlalchemys_back_is_no_done_without_effect(
    orders, effects, how
):
    """A ROLLBACK sent as SQL (or on the DBAPI connection) undoes the effect; pgq then
    acks in a fresh transaction of its own: the message is done without its effect
    (an ack without its effect). The attempt must fail instead."""
    mid = pgq.publish(orders, "orders", {"n": 1})

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if how == "sql_rollback":
            conn.execute(text("ROLLBACK"))
        else:
            conn.connection.rollback()

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, max_attempts=1, **FAST)
    summary = consumer.run(until_empty=True, max_runtime=WAIT)
    found = effect_counts(orders, effects)
    # before: done == 1 and no effect row (the ack committed alone)
    assert (summary.done, summary.dead, found) == (0, 1, Counter()), (found, summary)
    row = rows(orders, "billing")[mid]
    assert "transactional handler must not" in row.last_error, row.last_error


@pytest.mark.parametrize("how", ["invalidate", "dbapi_close"])
def test_a_handler_that_breaks_its_connection_fails_clearly(orders, effects, how):
    """`conn.invalidate()` or closing the DBAPI connection under `conn`: the attempt
    fails with pgq's clear error (charged, dead at max_attempts=1), nothing written;
    the member keeps running (no crashed thread, no endless free reclaims)."""
    mid = pgq.publish(orders, "orders", {"n": 1})
    calls: list[int] = []

    def handler(message: pgq.Message, conn: Connection) -> None:
        calls.append(message.attempt)
        write_effect(effects, message, conn)
        if how == "invalidate":
            conn.invalidate()
        else:
            conn.connection.dbapi_connection.close()

    consumer = pgq.Consumer(
        orders, "billing", handler, transactional=True, max_attempts=1, lease=2.0, **FAST
    )
    summary = consumer.run(until_empty=True, max_runtime=15.0)
    assert effect_counts(orders, effects) == Counter()
    assert consumer.clean, summary
    assert summary.stop_reason == "empty", summary
    assert (summary.dead, summary.refused) == (1, 0), (summary, calls)
    row = rows(orders, "billing")[mid]
    assert row.state == "dead"
    assert "transactional handler must not" in row.last_error, row.last_error


@pytest.mark.parametrize("where", ["swallowed_error", "deferred_constraint"])
def test_a_failure_after_the_handler_returned_is_written(orders, schema, effects, where):
    """The attempt fails after the handler returned: its transaction was aborted by a
    statement error the handler swallowed, or a deferred constraint refuses the
    COMMIT. The failure must be written (retried, charged) and the next attempt
    commit the effect once. Before: the worker had already taken the attempt back
    (`proceed`), so its failure was "late outcome discarded ... (handler timed out)";
    the row stayed leased to the member (its lease extended) and never ran again."""
    if where == "deferred_constraint":
        with orders.begin() as conn:
            conn.execute(
                text(
                    f'CREATE FUNCTION "{schema}".first_refused() RETURNS trigger'
                    " LANGUAGE plpgsql AS $$ BEGIN IF NEW.attempt = 1 THEN"
                    " RAISE EXCEPTION 'first attempt refused at commit'; END IF;"
                    " RETURN NULL; END $$"
                )
            )
            conn.execute(
                text(
                    f"CREATE CONSTRAINT TRIGGER first_refused AFTER INSERT ON {effects}"
                    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
                    f' EXECUTE FUNCTION "{schema}".first_refused()'
                )
            )
    ids = pgq.publish_many(orders, "orders", [{"n": 1}])

    def handler(message: pgq.Message, conn: Connection) -> None:
        write_effect(effects, message, conn)
        if where == "swallowed_error" and message.attempt == 1:
            try:
                conn.execute(text("SELECT 1/0"))
            except Exception:
                pass

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, **FAST)
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=15.0)
    assert (summary.done, summary.retried, summary.refused) == (1, 1, 0), summary
    assert summary.stop_reason == "empty", summary
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == 1


def test_a_savepoint_left_open_commits_with_the_ack(orders, effects):
    """A handler that opens a savepoint and returns without releasing it: its writes
    in the savepoint commit with the ack (or the attempt fails); never an ack alone."""
    ids = pgq.publish_many(orders, "orders", [{"n": 1}, {"n": 2}])

    def handler(message: pgq.Message, conn: Connection) -> None:
        conn.begin_nested()
        write_effect(effects, message, conn)

    consumer = pgq.Consumer(orders, "billing", handler, transactional=True, **FAST)
    summary = consumer.run(until_empty=True, wait_retries=3.0, max_runtime=WAIT)
    found = effect_counts(orders, effects)
    assert summary.done == 2, summary
    assert found == Counter(ids), found


def batch_consumer(
    engine: Engine, batch: Callable[[list[pgq.Message], Connection], None], **settings: object
) -> pgq.Consumer:
    """A transactional consumer of `billing` with the batch handler `batch`, one worker."""
    return pgq.Consumer(
        engine,
        "billing",
        batch_handler=batch,
        transactional=True,
        workers=1,
        **{**FAST, **settings},  # type: ignore[arg-type]
    )


MISBEHAVIOURS = [
    "sql_commit",
    "dbapi_commit",
    "conn_commit_swallowed",
    "sql_rollback",
    "dbapi_rollback",
    "conn_rollback",
    "conn_close",
    "invalidate",
    "dbapi_close",
]


def misbehave(conn: Connection, how: str) -> None:
    """End pgq's transaction, or the connection, the way `how` says."""
    if how == "sql_commit":
        conn.execute(text("COMMIT"))
    elif how == "dbapi_commit":
        conn.connection.commit()
    elif how == "conn_commit_swallowed":
        try:
            conn.commit()
        except pgq.PgqError:
            pass
    elif how == "sql_rollback":
        conn.execute(text("ROLLBACK"))
    elif how == "dbapi_rollback":
        conn.connection.rollback()
    elif how == "conn_rollback":
        conn.rollback()
    elif how == "conn_close":
        conn.close()
    elif how == "invalidate":
        conn.invalidate()
    else:
        conn.connection.dbapi_connection.close()


@pytest.mark.parametrize("how", MISBEHAVIOURS)
def test_a_batch_handler_that_ends_the_transaction_or_the_connection_leaves_each_effect_once(
    orders, effects, how
):
    """The batch handler writes its batch's effects, then ends pgq's transaction (a
    commit by any route, a rollback) or its connection midway, and writes on where
    it can: that attempt fails for the whole batch with nothing of it kept, the
    member runs on, and the batch's next attempt commits each effect once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(4)])
    calls: list[int] = []

    def batch(messages: list[pgq.Message], conn: Connection) -> None:
        calls.append(len(messages))
        first, *rest = messages
        write_effect(effects, first, conn)
        if len(calls) == 1:
            try:
                misbehave(conn, how)
            except pgq.PgqError:
                if how not in ("sql_commit", "dbapi_commit"):
                    raise
        for message in rest:
            try:
                write_effect(effects, message, conn)
            except Exception:
                if len(calls) > 1:
                    raise

    consumer = batch_consumer(orders, batch, max_attempts=3, lease=2.0)
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=WAIT)
    assert consumer.clean, summary
    assert (summary.stop_reason, summary.done, summary.dead) == ("empty", 4, 0), (summary, calls)
    assert effect_counts(orders, effects) == Counter(ids)
    assert done_count(orders) == 4


def test_savepoints_in_a_batch_handler_are_its_own(orders, effects):
    """A batch handler that works each message in a savepoint: released, rolled back
    (`ROLLBACK TO` by SQL or `begin_nested().rollback()`) and written again, or left
    open. What its savepoints kept commits with the acks, each effect once."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(6)])

    def batch(messages: list[pgq.Message], conn: Connection) -> None:
        for n, message in enumerate(messages):
            if n % 3 == 0:
                with conn.begin_nested():
                    write_effect(effects, message, conn)
            elif n % 3 == 1:
                conn.execute(text("SAVEPOINT again"))
                write_effect(effects, message, conn)
                conn.execute(text("ROLLBACK TO SAVEPOINT again"))
                nested = conn.begin_nested()
                write_effect(effects, message, conn)
                nested.rollback()
                write_effect(effects, message, conn)
            else:
                conn.begin_nested()  # left open
                write_effect(effects, message, conn)

    consumer = batch_consumer(orders, batch)
    summary = consumer.run(until_empty=True, wait_retries=3.0, max_runtime=WAIT)
    assert (summary.done, summary.refused, summary.retried) == (6, 0, 0), summary
    assert effect_counts(orders, effects) == Counter(ids)


@pytest.mark.parametrize("names", ["nothing", "ids_as_text", "other_ids"])
def test_a_partial_failure_that_names_no_message_of_its_batch_fails_the_batch(
    orders, effects, names
):
    """`PartialFailure` fails the messages it names and sends the others back
    uncharged. One that names none of its batch's messages (empty; ids as text, as
    they come back from JSON; ids of another batch) sent every message back
    uncharged: the batch ran again at once, for ever, and never died. It must fail
    the whole batch, charged, saying why."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])
    calls: list[int] = []

    def batch(messages: list[pgq.Message], conn: Connection) -> None:
        calls.append(len(messages))
        for message in messages:
            write_effect(effects, message, conn)
        if names == "nothing":
            raise pgq.PartialFailure({})
        if names == "ids_as_text":
            raise pgq.PartialFailure({str(m.id): ValueError("bad") for m in messages})  # type: ignore[misc]
        raise pgq.PartialFailure({m.id + 1000: ValueError("bad") for m in messages})

    consumer = batch_consumer(orders, batch, max_attempts=2)
    summary = consumer.run(until_empty=True, wait_retries=5.0, max_runtime=10.0)
    assert (summary.stop_reason, summary.dead) == ("empty", 3), (summary, len(calls))
    assert len(calls) <= 6, len(calls)  # before: thousands of calls in the 10 s
    assert effect_counts(orders, effects) == Counter()
    found = rows(orders, "billing")
    assert all("PartialFailure" in found[mid].last_error for mid in ids), found
