"""The `pgq` command: a thin click layer over pgq's plain functions.

- `startup`: stop signals before a command has handlers of its own;
- `commands`: registers every command on the root group (the only place that
  knows them all);
- `base`: the root group and its global options, `State`, the error-to-exit-code
  mapping (`pgq: error: ...` and exit 2; `UNKNOWN` and exit 3 for `check`),
  logging setup, DSN handling, `--json` and `emit`;
- `render`: the human lines for status, members, breaker, dead, server status;
- `setup`: `init`, `topic create`, `subscribe`, `publish` (and its JSON input);
- `inspect`: `status`, `members`, `breaker`, `dead`, `check`;
- `lifecycle`: `topics`, `topic delete`, `unsubscribe`;
- `admin`: `requeue`, `purge`, `show`, `audit`;
- `grant`: `grant` (least-privilege roles);
- `consume`: `consume`, its exit codes and signal handlers;
- `server`: `server status`, `server stop`;
- `demo`: `demo`, whose narration it prints;
- `web`: `web`, the dashboard (`pgq.web`, the `web` extra).

This package imports nothing heavy at the top: `main` holds the stop signals
first, then imports the commands (SQLAlchemy, psycopg, ...); `cli` is imported
on first use.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pgq.cli import startup

if TYPE_CHECKING:
    from pgq.cli.commands import cli

__all__ = ["cli", "main"]


def __getattr__(name: str) -> Any:
    if name == "cli":
        from pgq.cli.commands import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point."""
    startup.hold()
    try:
        from pgq.cli.commands import cli

        cli.main(args=list(argv) if argv is not None else None, prog_name="pgq")
    except startup.Stopped as stop:
        from pgq.cli import logs

        args = list(argv) if argv is not None else sys.argv[1:]
        logs.use_format(logs.format_asked(args, os.environ))
        logs.report(stop.line, "stopped", level="WARNING", signal=stop.name)
        sys.exit(stop.exit_code)
