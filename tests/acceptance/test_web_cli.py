"""`pgq web`'s own usage errors: one line, exit 2, never a traceback; its admin
tokens, one per person (issue 21)."""

from __future__ import annotations

import http.client
import re
import signal
import urllib.parse

import pytest
from helpers import assert_usage_error, finish, invoke, kill, spawn_pgq, wait_until

import pgq
import pgq.monitor

pytest.importorskip("flask")

ALICE = "alice-7f3c9e1b5a2d8064"
BOB = "bob-c4e9a17f03d85b26"


@pytest.mark.parametrize("host", ["bad host", "999.1.1.1", ""])
def test_an_address_that_is_not_this_machines_is_one_line(engine, pgq_env, host):
    result = invoke(pgq_env, "web", "--host", host, "--port", "0")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"pgq: error: cannot listen on {host!r}: not an address of this machine"
    ]


@pytest.mark.parametrize(
    ("env", "file_text", "says"),
    [
        ({"PGQ_WEB_TOKEN": " " * 16}, None, "$PGQ_WEB_TOKEN: the token of 'admin' is too weak"),
        ({"PGQ_WEB_TOKEN": "a" * 32}, None, "fewer than 8 different characters"),
        ({"PGQ_WEB_TOKEN": "x" * 15}, None, "at least 16 characters"),
        ({}, None, "--admin needs a token"),
        ({}, "alice:4f9a1c7e2b8d6035\nbob:bbbbbbbbbbbbbbbbbbbbbb\n", "line 2: the token of 'bob'"),
        ({"PGQ_WEB_TOKENS": "alice"}, None, "$PGQ_WEB_TOKENS: each entry is NAME:TOKEN"),
    ],
)
def test_a_weak_or_malformed_admin_token_stops_it_at_start(
    engine, pgq_env, tmp_path, env, file_text, says
):
    """Failed before the strength rule: sixteen spaces in $PGQ_WEB_TOKEN started an
    admin dashboard (issue 21)."""
    args = ["web", "--admin", "--port", "0"]
    if file_text is not None:
        tokens = tmp_path / "tokens"
        tokens.write_text(file_text)
        tokens.chmod(0o600)
        args += ["--tokens-file", str(tokens)]
    result = invoke(pgq_env, *args, **env)
    assert_usage_error(result.exit_code, result.stderr, contains=says)
    assert "4f9a1c7e2b8d6035" not in result.stderr


def test_an_unreadable_tokens_file_is_one_line(engine, pgq_env, tmp_path):
    missing = tmp_path / "nope"
    result = invoke(pgq_env, "web", "--admin", "--port", "0", "--tokens-file", str(missing))
    assert_usage_error(result.exit_code, result.stderr, contains="cannot read the tokens file")


@pytest.mark.slow
def test_a_tokens_file_names_who_changed_what(engine, pgq_env, tmp_path):
    """`pgq web --admin --tokens-file` as a real process: bob's token purges as bob."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    kill(engine, pgq.publish_many(engine, "t", [{"n": 1}]), "message")  # something to purge
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# on call\nalice:{ALICE}\nbob:{BOB}\n")
    tokens.chmod(0o644)  # readable by others: a warning, not a refusal
    log = tmp_path / "web.log"
    args = ("web", "--admin", "--port", "0", "--tokens-file", str(tokens))
    proc = spawn_pgq(pgq_env, *args, log=log)
    try:

        def url() -> str:
            assert proc.poll() is None, log.read_text()
            found = re.search(r"^pgq web: (http://\S+/) ", log.read_text(), re.MULTILINE)
            return found.group(1) if found else ""

        parts = urllib.parse.urlsplit(wait_until(url, 60, "pgq web to listen", interval=0.1))
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request(
            "POST",
            "/groups/g/purge",
            body="reason=on+call",
            headers={
                "Authorization": f"Bearer {BOB}",
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.send_signal(signal.SIGINT)
        code, _, _ = finish(proc, 30)
    assert code == 0, log.read_text()
    [row] = pgq.monitor.audit(engine, "g")
    assert row["actor"] == "bob (pgq web)"
    text = log.read_text()
    assert "tokens file readable by others" in text
    assert ALICE not in text and BOB not in text
