"""`pgq.cli.logs.format_asked`: the log format a command line asks for, read before
click parses it (a stop during start-up must still write JSON when JSON was asked)."""

from __future__ import annotations

import pytest

from pgq.cli.logs import format_asked


@pytest.mark.parametrize(
    ("args", "environ", "asked"),
    [
        ([], {}, "text"),
        (["consume", "g"], {"PGQ_LOG_FORMAT": "json"}, "json"),
        (["--log-format", "json", "consume", "g"], {}, "json"),
        (["--log-format=json", "status"], {}, "json"),
        (["--log-format", "text", "status"], {"PGQ_LOG_FORMAT": "json"}, "text"),
        (["--log-format", "json", "--log-format", "text", "status"], {}, "text"),
        (["-v", "--log-format", "json", "status"], {}, "json"),
        (["--dsn", "postgresql://h/db", "--log-format", "json", "consume", "g"], {}, "json"),
        (["--schema", "s", "--config", "c.toml", "--log-format=json", "check", "g"], {}, "json"),
        # after the command, the words are the command's own
        (["publish", "t", "--log-format", "json"], {}, "text"),
        (["--log-format"], {}, "text"),
    ],
)
def test_the_format_is_read_from_the_global_options_then_the_environment(
    args: list[str], environ: dict[str, str], asked: str
) -> None:
    assert format_asked(args, environ) == asked
