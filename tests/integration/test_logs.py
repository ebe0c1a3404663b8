"""The CLI's log lines: one event a line, key=value text or JSON, never a secret."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import subprocess
import sys
import threading

import pytest
from helpers import FAST, PGQ, consumer_env, invoke, wait_until
from hypothesis import assume, given
from hypothesis import strategies as st

import pgq
from pgq.cli.logs import (
    JsonFormatter,
    TextFormatter,
    configure_logging,
    fields,
    quote,
    report,
    scrub,
    use_format,
)
from pgq.consumer import progress
from pgq.logcontext import carrying, get_logger, log_fields


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("pgq.consumer", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_fields_pair_each_key_with_its_argument():
    r = record("done %d%% group=%s n=%d took=%.2f s %s tail=%r", 50, "g", 3, 1.5, "x", None)
    assert fields(r) == {"group": "g", "n": 3, "took": 1.5, "tail": None}
    assert fields(record("no fields")) == {}
    assert fields(record("too few group=%s member=%s", "g")) == {"group": "g"}


def test_json_lines_carry_time_level_logger_message_and_fields():
    line = JsonFormatter().format(record("member joined group=%s member=%s", "g", "m\nx"))
    assert "\n" not in line
    event = json.loads(line)
    assert event["level"] == "WARNING" and event["logger"] == "pgq.consumer"
    assert event["message"] == 'member joined group=g member="m\\nx"'
    assert (event["group"], event["member"]) == ("g", "m\nx")
    assert event["time"].endswith("+00:00")
    failed = json.loads(JsonFormatter().format(record("task failed task=%s", "t", exc=True)))
    assert "ValueError: boom" in failed["exception"] and failed["task"] == "t"


def test_a_text_line_cannot_be_forged():
    forged = "m\n2026-12-01T00:00:00 ERROR pgq: FORGED\x1b]0;x\x07"
    line = TextFormatter().format(record("thread crashed member=%s", forged))
    assert "\n" not in line and line.isprintable()
    assert line.endswith('member="m\\n2026-12-01T00:00:00 ERROR pgq: FORGED\\x1b]0;x\\x07"')


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cannot connect dsn=host=db password=hunter2 user=app", "password=*** user=app"),
        ("password = 'a b\\'c' dbname=x", "password = *** dbname=x"),
        ("at postgresql://app:hunter2@db:5432/x failed", "postgresql://app:***@db:5432/x"),
    ],
)
def test_secrets_never_reach_a_log_line(text, expected):
    assert expected in scrub(text) and "hunter2" not in scrub(text)
    line = JsonFormatter().format(record("connect failed error=%s", text))
    assert "hunter2" not in line and "a b" not in line


def test_the_cli_writes_json_lines_with_log_format_json(pgq_env, capsys):
    result = invoke(pgq_env, "--log-format", "json", "init")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stderr.splitlines()]
    applied = [e for e in events if e["message"].startswith("migration applied")]
    assert applied and applied[0]["version"] == 1 and applied[0]["schema"] == pgq_env["PGQ_SCHEMA"]
    again = invoke(pgq_env, "status", PGQ_LOG_FORMAT="json")  # the variable is not a setting
    assert again.exit_code == 0, again.stderr
    configure_logging(0)


def test_a_traceback_in_a_text_line_keeps_its_lines_but_no_secret_nor_escape():
    try:
        raise ValueError("cannot reach postgresql://app:hunter2@db/x\x1b]0;owned\x07")
    except ValueError:
        r = logging.LogRecord("pgq", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = TextFormatter().format(r)
    assert "hunter2" not in text and "\x1b" not in text
    assert all(line.isprintable() for line in text.splitlines())
    assert text.splitlines()[-1].startswith("ValueError: cannot reach postgresql://app:***@db/x")


# -- key=value text that no value can forge (issue 21) -------------------------------

_TOKEN = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?=\s|$)|\S+')


def logfmt(line: str) -> list[tuple[str, str]]:
    """The `key=value` fields of a text line after `logger: `, quoted values decoded
    (they are written as Python writes a string's escapes)."""
    body = line.split(": ", 1)[1]
    found = []
    for match in _TOKEN.finditer(body):
        if match.group(1):
            value = match.group(2)
            found.append((match.group(1), ast.literal_eval(value) if value[:1] == '"' else value))
    return found


HOSTILE = [
    "m1 group=payments level=ERROR",
    'm1" level=ERROR x="',
    "m1\\",
    'a\\" level=ERROR',
    "tab\there",
    "new\nline level=ERROR",
    "\x1b[31mred\x1b[0m",
    "bidi\u202eRORRE=level",
    "",
    "=",
    "no-break\xa0space=1",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_hostile_value_stays_one_field_in_a_text_line(value):
    line = TextFormatter().format(record("member joined group=%s member=%s n=%d", "g", value, 3))
    assert "\n" not in line and line.isprintable()
    assert logfmt(line) == [("group", "g"), ("member", value), ("n", "3")]
    event = json.loads(JsonFormatter().format(record("joined member=%s", value)))
    assert event["member"] == value and set(event) == {
        "time",
        "level",
        "logger",
        "message",
        "member",
    }


@given(st.text())
def test_no_text_value_can_forge_a_field(value):
    assume(scrub(value) == value)  # a password-like value is replaced, by design
    line = TextFormatter().format(record("member joined group=%s member=%s", "g", value))
    assert logfmt(line) == [("group", "g"), ("member", value)]


@pytest.mark.parametrize(
    ("value", "written"),
    [
        ("plain", "plain"),
        ("host:12:ab", "host:12:ab"),
        ("a b", '"a b"'),
        ("a=b", '"a=b"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("line\nbreak", '"line\\nbreak"'),
        ("", '""'),
    ],
)
def test_quote_leaves_a_plain_word_and_quotes_the_rest(value, written):
    assert quote(value) == written


def test_a_value_that_is_not_a_field_is_quoted_when_it_could_pass_for_one():
    text = TextFormatter().format(record("stopping on %s now, after %d tries", "x level=ERROR", 3))
    assert text.endswith('stopping on "x level=ERROR" now, after 3 tries')
    assert TextFormatter().format(record("took %s", "a while")).endswith("took a while")


def test_a_quoted_value_keeps_its_closing_quote_when_a_password_is_scrubbed():
    line = TextFormatter().format(record("connect failed dsn=%s n=%d", "host=db password=pw", 1))
    assert line.endswith('dsn="host=db password=***" n=1'), line
    assert logfmt(line) == [("dsn", "host=db password=***"), ("n", "1")]


def test_bound_fields_reach_every_record_and_both_formats():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    base = logging.getLogger("pgq.test.bound")
    base.addHandler(handler)
    base.setLevel(logging.INFO)
    log = get_logger("pgq.test.bound")
    try:
        log.info("outside n=%d", 1)
        with log_fields(group="g", member="m 1"):
            log.info("inside n=%d", 2)
            log.info("named group=%s", "g")
            with log_fields(member="m2"):
                log.info("nested")
            thread = threading.Thread(target=carrying(lambda: log.info("thread")))
            thread.start()
            thread.join()
            log.info("with extra", extra={"by": "quorum"})
        log.info("after")
    finally:
        base.removeHandler(handler)
    assert [(getattr(r, "group", None), getattr(r, "member", None)) for r in records] == [
        (None, None),
        ("g", "m 1"),
        ("g", "m 1"),
        ("g", "m2"),
        ("g", "m 1"),
        ("g", "m 1"),
        (None, None),
    ]
    text = [TextFormatter().format(r) for r in records]
    assert text[1].endswith('inside n=2 group=g member="m 1"')
    assert text[2].endswith('named group=g member="m 1"')  # not twice
    assert text[5].endswith('with extra group=g member="m 1" by=quorum')
    assert text[0].endswith("outside n=1")
    event = json.loads(JsonFormatter().format(records[1]))
    assert (event["group"], event["member"], event["n"]) == ("g", "m 1", 2)


def test_report_writes_the_same_line_as_before_in_text_and_one_object_in_json(capsys):
    use_format("text")
    report("handled=1 stop_reason=empty", "run summary", handled=1, stop_reason="empty")
    assert capsys.readouterr().err == "handled=1 stop_reason=empty\n"
    use_format("json")
    try:
        report("text", "run summary", level="INFO", handled=1, rate=1.5, dsn="x password=pw")
    finally:
        use_format("text")
    event = json.loads(capsys.readouterr().err)
    assert event["message"] == "run summary" and event["level"] == "INFO"
    assert (event["handled"], event["rate"], event["dsn"]) == (1, 1.5, "x password=***")


# -- everything else pgq writes to stderr: the run summary, errors (issue 21) ---------


def test_with_json_the_run_summary_and_every_line_of_a_run_are_json_objects(
    orders, pgq_env, tmp_path
):
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(3)])
    env = consumer_env(pgq_env, tmp_path)
    args = ["consume", "billing", "--handler", "handlers:record", "--until-empty"]
    run = subprocess.run(
        [*PGQ, "--log-format", "json", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in run.stderr.splitlines()]
    assert all(e["group"] == "billing" and e["member"] for e in events), events
    summary = events[-1]
    assert summary["message"] == "run summary" and summary["level"] == "INFO"
    assert (summary["handled"], summary["done"], summary["stop_reason"]) == (3, 3, "empty")
    [left] = [e for e in events if e["message"].startswith("member left")]
    assert (left["handled"], left["refused"], left["stop_reason"]) == (3, 0, "empty")

    text = subprocess.run([*PGQ, *args], env=env, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert text.stderr.splitlines()[-1] == (  # as it always was
        "handled=0 done=0 retried=0 dead=0 released=0 reclaimed=0 waiting_retry=0"
        " refused=0 stop_reason=empty"
    )


@pytest.mark.parametrize(
    ("args", "fields"),
    [
        (("consume", "billing", "--handler", "no_such_module:f"), {"group": "billing"}),
        (("consume", "billing", "--handler", "h:f", "--workers", "0"), {}),
        (("no-such-command",), {}),
        (("status", "nosuch"), {"group": "nosuch"}),
        (("dead", "nosuch"), {"group": "nosuch"}),
        (("publish", "nosuch", "{"), {"topic": "nosuch"}),
    ],
)
def test_with_json_an_error_is_one_json_object(orders, pgq_env, args, fields):
    result = invoke(pgq_env, "--log-format", "json", *args)
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.splitlines()
    event = json.loads(line)
    assert event["level"] == "ERROR" and event["exit_code"] == 2
    assert event["message"] == event["error"] and event["error"]
    assert {k: event[k] for k in fields} == fields
    again = invoke(pgq_env, *args)  # and in text, the line it always was
    assert again.stderr.splitlines() == [f"pgq: error: {event['error']}"]


# -- the progress line: alive, and how fast (issue 21) --------------------------------


def test_rate_is_per_second_to_one_decimal():
    assert (progress.rate(90, 60.0), progress.rate(1, 3.0), progress.rate(5, 0.0)) == (
        1.5,
        0.3,
        0.0,
    )


def test_a_member_logs_its_progress_once_an_interval(orders, monkeypatch, caplog):
    monkeypatch.setattr(progress, "PROGRESS_EVERY", 0.3)
    caplog.set_level(logging.INFO, logger="pgq.consumer")
    pgq.publish_many(orders, "orders", [{"n": i} for i in range(20)])
    gate = threading.Event()
    c = pgq.Consumer(orders, "billing", lambda m: gate.wait(10), workers=2, **FAST)

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("progress ")]

    c.start()
    try:
        wait_until(lambda: lines(), 10, "a progress line while the handlers wait")
        gate.set()
        wait_until(
            lambda: (fields(lines()[-1])["lag"], fields(lines()[-1])["handled"]) == (0, 0),
            20,
            "a progress line of an idle member",
        )
    finally:
        c.stop()
    seen = [fields(r) | {"group": r.group, "member": r.member} for r in lines()]
    assert seen[0]["lag"] == 20 and seen[0]["handled"] == 0, seen  # nothing finished yet
    assert sum(s["handled"] for s in seen) == 20, seen  # each line: since the one before
    for s in seen:
        assert (s["group"], s["member"], s["breaker"], s["local_breaker"]) == (
            "billing",
            c.name,
            "CLOSED",
            "closed",
        )
        assert isinstance(s["rate"], float) and s["rate"] >= 0


# -- every line on stderr in pgq's format: other loggers and warnings (issue 21) ------

SHOP_HANDLER = """
import logging
import warnings


def handle(msg):
    logging.getLogger("shop").info("charged order %s", msg.id)
    logging.getLogger("shop").debug("not shown")
    warnings.warn("the handler's own warning", UserWarning, stacklevel=1)
"""


def test_a_handlers_own_lines_and_warnings_come_in_pgq_text_format(orders, pgq_env, tmp_path):
    """The CLI puts its handler on the root logger (decision 0032): a handler's own
    INFO lines show, in pgq's text format, and so do warnings; DEBUG does not."""
    (tmp_path / "shop_text_handlers.py").write_text(SHOP_HANDLER)
    pgq.publish(orders, "orders", {"n": 1})
    env = consumer_env(pgq_env, tmp_path, PGQ_POLL_INTERVAL=0.1)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    args = ("consume", "billing", "--handler", "shop_text_handlers:handle", "--until-empty")
    out = subprocess.run(
        [*PGQ, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert any(re.fullmatch(r"\S+ INFO shop: charged order \d+", line) for line in lines), lines
    warned = [line for line in lines if " WARNING py.warnings: " in line]
    assert len(warned) == 1 and "UserWarning: the handler's own warning" in warned[0], lines
    assert "not shown" not in out.stderr
    quiet = subprocess.run(
        [*PGQ, "--log-level", "WARNING", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert quiet.returncode == 0 and "charged order" not in quiet.stderr, quiet.stderr
