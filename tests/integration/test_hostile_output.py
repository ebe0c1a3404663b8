"""Hostile text never reaches the terminal raw (issue 11 #5, DESIGN §7).

Member names, topic and group names written by an older version or another
client, and a handler's exception text are printed by `pgq members`, `status`,
`dead`, `breaker` and `check` with their control characters escaped, whether
or not stdout is a terminal: no ESC, BEL, CR or C1 control passes, and a newline
cannot forge a row. `--json` stays exact JSON that gives the very same text back.
"""

from __future__ import annotations

import datetime as dt
import json

import pytest
from helpers import FAST, finish, invoke, spawn_pgq
from sqlalchemy import Engine, insert, select

import pgq
from pgq import schema as t
from pgq.cli.render import dead_lines, members_lines, one_line, table, visible
from pgq.read_models import MemberStatus
from pgq.records import LocalBreakerState

OSC = "\x1b]0;owned\x07"
"""Sets the terminal's title, even in output piped through `less -R` or a log."""

ERROR = f"{OSC}\nFORGED error line"
"""The text of the exception the handler raises."""

MEMBERS = (
    f"evil{OSC}",
    "x\nFORGED  yes  closed",
    "cr\roverwritten",
    "csi\x9b2J",  # a C1 control: CSI for terminals that take 8-bit controls
    "rtl\u202eevil",  # a right-to-left override reorders what the eye reads
    "tab\there",
)
"""Member names only an older version (or another client) could have written."""

GROUP2 = "g2\nFORGED group"
TOPIC2 = f"t2{OSC}"


def raw_lines(out: bytes) -> list[str]:
    """Lines of `out` (split on newlines only) that hold a character that is not
    printable, or that begin a forged row."""
    return [
        line
        for line in out.decode().split("\n")
        if line.startswith("FORGED") or not line.isprintable()
    ]


def fail(msg: pgq.Message) -> None:
    raise ValueError(ERROR)


@pytest.fixture
def hostile(engine: Engine) -> Engine:
    """Group `g` with the hostile members (who probed it, too) and one row a real
    handler killed with the hostile text; group `GROUP2` on topic `TOPIC2`, written
    with SQL."""
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    with engine.begin() as conn:
        gid = conn.scalar(select(t.consumer_group.c.id).where(t.consumer_group.c.name == "g"))
        conn.execute(
            insert(t.member),
            [{"group_id": gid, "name": n, "host": "old\x1b[2Jhost", "pid": 1} for n in MEMBERS],
        )
        conn.execute(
            insert(t.probe),
            [{"group_id": gid, "epoch": 1, "member": n, "outcome": "failed"} for n in MEMBERS],
        )
        tid = conn.scalar(insert(t.topic).values(name=TOPIC2).returning(t.topic.c.id))
        conn.execute(insert(t.consumer_group).values(name=GROUP2, topic_id=tid))
    pgq.publish(engine, "t", {"n": 1})
    summary = pgq.Consumer(engine, "g", fail, workers=1, max_attempts=1, **FAST).run(
        until_empty=True
    )
    assert summary.dead == 1
    return engine


COMMANDS = [
    ("members", "g"),
    ("status", "g"),
    ("status",),
    ("dead", "g"),
    ("breaker", "g"),
    ("check", "g"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_human_output_shows_control_characters_escaped(hostile, pgq_env, args):
    """Failed on 536941e for members, status and dead: ESC, BEL, CR, U+009B and
    U+202E printed raw, and the newlines in a member name, a group name and the
    error text forged rows (breaker and check had nothing hostile to print: guards)."""
    result = invoke(pgq_env, *args)
    assert result.exit_code in (0, 2), result.output  # check: CRITICAL for the dead row
    assert result.stdout_bytes.endswith(b"\n")
    assert raw_lines(result.stdout_bytes) == []


def test_what_is_escaped_stays_readable(hostile, pgq_env):
    out = invoke(pgq_env, "members", "g").output
    assert "evil\\x1b]0;owned\\x07" in out
    assert "x\\nFORGED  yes  closed" in out
    assert "csi\\x9b2J" in out and "rtl\\u202eevil" in out
    dead = invoke(pgq_env, "dead", "g").output
    # the error cell is one line: its newline collapses into a space like any whitespace
    assert "ValueError: \\x1b]0;owned\\x07 FORGED error line" in dead
    breaker = invoke(pgq_env, "breaker", "g").output
    assert "x\\nFORGED" in breaker and "cr\\roverwritten" in breaker  # probers shown
    everything = invoke(pgq_env, "status").output
    assert "g2\\nFORGED group" in everything and "t2\\x1b]0;owned\\x07" in everything


def test_json_output_gives_back_the_exact_text(hostile, pgq_env):
    """Held on 536941e too: a guard that escaping stays out of the JSON."""
    members = json.loads(invoke(pgq_env, "members", "g", "--json").stdout_bytes)
    assert set(MEMBERS) <= {m["name"] for m in members}
    assert {m["host"] for m in members if m["name"] in MEMBERS} == {"old\x1b[2Jhost"}
    [dead] = json.loads(invoke(pgq_env, "dead", "g", "--json").stdout_bytes)
    assert dead["error"] == f"ValueError: {ERROR}"
    breaker = json.loads(invoke(pgq_env, "breaker", "g", "--json").stdout_bytes)
    assert {p["member"] for p in breaker["probes"]} == set(MEMBERS)
    groups = json.loads(invoke(pgq_env, "status", "--json").stdout_bytes)["groups"]
    assert {(g["group"], g["topic"]) for g in groups} == {("g", "t"), (GROUP2, TOPIC2)}
    # json.dumps escapes every control and non-ASCII character: one line of ASCII
    out = invoke(pgq_env, "status", "g", "--json").stdout_bytes
    assert out.count(b"\n") == 1 and out.isascii()


def test_a_real_process_piped_prints_no_control_character(hostile, pgq_env):
    """Failed on 536941e: the defect did not depend on a terminal, OSC sequences
    and CRs survived a pipe."""
    for args in (("members", "g"), ("dead", "g"), ("status",)):
        proc = spawn_pgq(pgq_env, *args)
        proc.stdout.reconfigure(newline="")  # type: ignore[union-attr]  # keep CRs as they are
        code, out, err = finish(proc, 60)
        assert code == 0, err
        assert raw_lines(out.encode()) == [], args


# -- the renderers on their own ------------------------------------------------------


def test_visible_escapes_what_is_not_printable_and_nothing_else():
    assert visible("host:123:ab12 é ü 名前") == "host:123:ab12 é ü 名前"
    assert visible(OSC) == "\\x1b]0;owned\\x07"
    assert visible("a\nb\rc\td\x00e\x7f") == "a\\nb\\rc\\td\\x00e\\x7f"
    assert visible("\x9b\u202e\u2028\ud800") == "\\x9b\\u202e\\u2028\\ud800"
    assert visible(visible(ERROR)) == visible(ERROR)


def test_tables_measure_the_escaped_text():
    lines = table(("NAME", "N"), [("a\x1bb", 1), ("cccccc", 2)])
    assert lines == ["NAME    N", "a\\x1bb  1", "cccccc  2"]


def test_every_human_line_is_printable():
    now = dt.datetime.now(dt.timezone.utc)
    # `local_breaker` is a `LocalBreakerState` (the table's CHECK allows no other word)
    member = MemberStatus(
        name="x\nFORGED\x1b[2J",
        live=False,
        local_breaker=LocalBreakerState.CLOSED,
        last_seen=now,
        host="h\x07",
        pid=1,
        started_at=now,
        left_at=None,
    )
    assert all(line.isprintable() for line in members_lines([member], now=now))
    row = {
        "message_id": 1,
        "error_class": "message\x07",
        "attempts": 1,
        "reclaims": 0,
        "refunds": 0,
        "updated_at": None,
        "error": ERROR,
    }
    assert all(line.isprintable() for line in dead_lines([row], now=now))
    assert one_line(ERROR) == "\\x1b]0;owned\\x07 FORGED error line"
