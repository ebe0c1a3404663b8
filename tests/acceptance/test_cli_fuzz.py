"""Hostile input to every command: random names, payloads, ids, limits, settings.

Issue 11: whatever the input, the CLI answers with exit 0 or 2 (`check`: its
Nagios codes 0–3), an error is one line on stderr and never a traceback, and a
command that fails writes no row. The commands run in-process on the test's
schema (group `billing` on topic `orders` exists), so thousands of inputs take
seconds; `CLI_FUZZ_EXAMPLES` scales the run. (An environment value cannot hold
a NUL byte, so the generated settings from the environment have none.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from helpers import invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from pgq import schema as t
from pgq.settings import Settings

EXAMPLES = int(os.environ.get("CLI_FUZZ_EXAMPLES", "300"))
TABLES = (t.topic, t.consumer_group, t.message, t.delivery, t.audit, t.member, t.breaker)

odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "orders",
            "billing",
            "orders\n",
            "bil\x00ling",
            "\udc80",
            "\x1b]0;owned\x07",
            "\x1b[31mred",
            "pg_catalog",
            "information_schema",
            "a" * 200,
            "-",
            "--help",
            "",
            " ",
            "Robert'); DROP TABLE message;--",
        ]
    ),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["1e20", "2**63", "9223372036854775808", "0x10", "1_000", "nan", "-0"]),
    odd_text,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)
payloads = st.one_of(
    json_values.map(json.dumps),
    odd_text,
    st.sampled_from(["NaN", "Infinity", '{"a": 1', _deep(100_000), '"\\u0000"', '"\\ud800"']),
)
groups = st.one_of(st.just("billing"), odd_text)
topics = st.one_of(st.just("orders"), odd_text)
setting_names = st.sampled_from(sorted(Settings.__dataclass_fields__))


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


setting_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=20),
)


@st.composite
def config_file(draw: st.DrawFn) -> str:
    name = draw(setting_names)
    section, key = ("breaker", name[8:]) if name.startswith("breaker_") else ("consumer", name)
    if draw(st.booleans()):
        key = draw(st.text(max_size=10))
    value = draw(st.one_of(setting_values.map(_toml_value), st.text(max_size=20)))
    return f"[{section}]\n{json.dumps(key)} = {value}\n"


def _consume(group: str, workers: str, batch: str, runtime: str, name: str) -> tuple[str, ...]:
    handler = "no_such_module_pgq:f"  # never a real handler: a fuzzer must not run code
    options = ("--workers", workers, "--batch-size", batch, "--max-runtime", runtime)
    return ("consume", group, "--handler", handler, "--until-empty", *options, "--name", name)


commands = st.one_of(
    st.tuples(st.just("topic"), st.just("create"), topics),
    st.tuples(st.just("subscribe"), groups, topics),
    st.tuples(st.just("publish"), topics, payloads),
    st.builds(lambda t, p, k: ("publish", t, p, "--key", k), topics, payloads, odd_text),
    st.builds(lambda g, i, r: ("requeue", g, "--id", i, "--reason", r), groups, numbers, odd_text),
    st.builds(lambda g, n: ("dead", g, "--limit", n), groups, numbers),
    st.builds(lambda g, n: ("breaker", g, "--limit", n), groups, numbers),
    st.tuples(st.sampled_from(["status", "members", "check"]), groups),
    st.builds(lambda g, i: ("show", g, i), groups, numbers),
    st.builds(
        lambda g, d, r: ("purge", g, "--dead", "--older-than", d, "--reason", r),
        groups,
        numbers,
        odd_text,
    ),
    st.builds(lambda g, n: ("audit", g, "--limit", n), groups, numbers),
    st.builds(
        lambda r, job: ("grant", r, job, "--print"),
        odd_text,
        st.sampled_from(["--producer", "--consumer", "--admin", "--nope"]),
    ),
    st.builds(
        lambda g, c, r: ("requeue", g, "--all", "--class", c, "--reason", r),
        groups,
        st.one_of(st.sampled_from(["systemic", "message", "permanent", "lease"]), odd_text),
        odd_text,
    ),
    st.builds(lambda s: ("--schema", s, "status", "billing"), odd_text),
    st.builds(_consume, groups, numbers, numbers, numbers, odd_text),
)


def counts(engine: Engine) -> tuple[int, ...]:
    with engine.connect() as conn:
        return tuple(int(conn.scalar(select(func.count()).select_from(x)) or 0) for x in TABLES)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    args=commands,
    stdin=st.none() | payloads,
    config=st.none() | config_file(),
    env=st.none() | st.tuples(setting_names, numbers.filter(lambda v: "\x00" not in v)),
)
def test_every_input_is_answered_with_exit_0_or_2_in_one_line_and_nothing_half_written(
    orders: Engine,
    pgq_env: dict[str, str],
    tmp_path: Path,
    args: tuple[str, ...],
    stdin: str | None,
    config: str | None,
    env: tuple[str, str] | None,
) -> None:
    extra: dict[str, str] = {}
    if config is not None:
        path = tmp_path / "pgq.toml"
        path.write_text(config, encoding="utf-8", errors="surrogatepass")
        args = ("--config", str(path), *args)
    if env is not None:
        extra[f"PGQ_{env[0].upper()}"] = env[1]
    before = counts(orders)
    data = None if stdin is None else stdin.encode("utf-8", "surrogatepass")  # raw bytes
    result = invoke(pgq_env, *args, stdin=data, **extra)
    allowed = {0, 1, 2, 3} if "check" in args else {0, 2}
    assert result.exit_code in allowed, (args, result.output, result.exception)
    assert isinstance(result.exception, SystemExit | None), (args, result.exception)
    assert "Traceback" not in result.stderr
    if result.exit_code == 2 and "check" not in args:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("pgq: error: "), (args, result.stderr)
        assert counts(orders) == before, args
