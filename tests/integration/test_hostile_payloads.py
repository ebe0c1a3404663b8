"""Payloads nested deeper than Python's JSON goes (issue 11 #3).

PostgreSQL's jsonb accepts nesting far deeper than Python's JSON decoder (about
1,000 levels), so a message written by another client can be unreadable here:
it must fail alone, as `permanent`, never take the member down.
"""

from __future__ import annotations

import pytest
from helpers import FAST, assert_usage_error, invoke
from sqlalchemy import text

import pgq
from pgq.errors import InvalidPayload

DEEP = '{"a":' * 5000 + "1" + "}" * 5000


def test_a_message_too_deep_to_decode_dies_alone_and_the_member_runs_on(orders, schema):
    """Failed on 118429e: the fetcher thread crashed on RecursionError and the member
    stopped, leaving the whole claim leased (and the next member crashed the same way)."""
    ids = pgq.publish_many(orders, "orders", [{"n": i} for i in range(5)])
    with orders.begin() as conn:
        conn.execute(
            text(f'UPDATE "{schema}".message SET payload = CAST(:p AS jsonb) WHERE id = :id'),
            {"p": DEEP, "id": ids[2]},
        )
    seen: list[int] = []
    consumer = pgq.Consumer(orders, "billing", lambda m: seen.append(m.id), **FAST)
    summary = consumer.run(until_empty=True)
    assert (summary.stop_reason, summary.done, summary.dead) == ("empty", 4, 1)
    assert sorted(seen) == sorted(ids[:2] + ids[3:])
    [dead] = pgq.monitor.dead(orders, "billing")
    assert dead["message_id"] == ids[2] and dead["error_class"] == "permanent"
    assert dead["error"].startswith("the stored message cannot be decoded: RecursionError")


def test_publishing_a_payload_too_deep_to_encode_is_refused_and_writes_nothing(orders):
    deep: object = 1
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(InvalidPayload, match="nested too deeply"):
        pgq.publish(orders, "orders", deep)
    assert pgq.status(orders, "billing")["counts"]["ready"] == 0


def test_the_cli_refuses_a_payload_too_deep_in_one_line(orders, pgq_env):
    for args, stdin in ((("publish", "orders", DEEP), None), (("publish", "orders", "-"), DEEP)):
        result = invoke(pgq_env, *args, stdin=stdin)
        assert_usage_error(result.exit_code, result.stderr, contains="nested too deeply")
    assert pgq.status(orders, "billing")["counts"]["ready"] == 0


@pytest.mark.parametrize("key", ["a\x00b", "\udc80", 5])
def test_a_key_postgresql_cannot_store_is_refused_in_one_line(orders, key):
    """Failed on the commit before (a lone surrogate raised UnicodeEncodeError)."""
    with pytest.raises(InvalidPayload, match="key"):
        pgq.publish(orders, "orders", {"n": 1}, key=key)
    assert pgq.status(orders, "billing")["counts"]["ready"] == 0
