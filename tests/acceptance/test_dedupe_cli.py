"""`pgq publish --dedupe-key K` (schema version 7, decision 0040): the real command
publishes once per key and prints the first id again; a bad key is one line and exit
2, with nothing published."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import PGQ, assert_usage_error, invoke
from sqlalchemy import Engine, func, select

from pgq import schema as t


def message_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(t.message)) or 0)


def test_publish_with_a_dedupe_key_prints_the_first_id_again_and_show_prints_the_key(
    orders, pgq_env
):
    first = invoke(pgq_env, "publish", "orders", '{"n": 1}', "--dedupe-key", "order-17")
    assert first.exit_code == 0, first.output
    again = invoke(pgq_env, "publish", "orders", "-", "--dedupe-key", "order-17", stdin="2\n")
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout and first.stdout.strip().isdigit()
    assert message_count(orders) == 1
    mid = first.stdout.strip()
    shown = invoke(pgq_env, "show", "billing", mid)
    assert "dedupe_key       order-17" in shown.stdout.splitlines()
    as_json = json.loads(invoke(pgq_env, "show", "billing", mid, "--json").stdout)
    assert (as_json["dedupe_key"], as_json["payload"]) == ("order-17", {"n": 1})


@pytest.mark.parametrize(
    ("args", "stdin", "says"),
    [
        (("orders", "{}", "--dedupe-key", ""), None, "dedupe key must be 1-512 characters"),
        (("orders", "{}", "--dedupe-key", "x" * 513), None, "characters, not 513"),
        (("orders", "-", "--dedupe-key", "k"), "1\n2\n", "publishes one message: got 2"),
        (("orders", "--dedupe-key", "k"), "", "publishes one message: got 0"),
        (("nowhere", "{}", "--dedupe-key", "k"), None, "unknown topic 'nowhere'"),
    ],
)
def test_a_bad_dedupe_key_or_input_is_one_line_and_exit_2(orders, pgq_env, args, stdin, says):
    result = invoke(pgq_env, "publish", *args, stdin=stdin)
    assert_usage_error(result.exit_code, result.stderr, contains=says)
    assert message_count(orders) == 0


def test_a_dedupe_key_that_is_not_text_is_one_line_and_exit_2(orders, pgq_env):
    """Bytes that are not UTF-8 in the argument (Python hands them on as lone
    surrogates), through the real command."""
    done = subprocess.run(
        [*PGQ, "publish", "orders", "{}", "--dedupe-key", b"order-\xff\xfe"],
        env=pgq_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_usage_error(done.returncode, done.stderr, contains="dedupe key is not valid text")
    assert done.stdout == "" and message_count(orders) == 0
