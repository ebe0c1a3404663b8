"""The `pgq` command: a thin click layer over pgq's plain functions.

- `base`: the root group and its global options, `State`, the error-to-exit-code
  mapping (`pgq: error: ...` and exit 2; `UNKNOWN` and exit 3 for `check`),
  logging setup, DSN handling, `--json` and `emit`;
- `render`: the human lines for status, members, breaker, dead, server status;
- `setup`: `init`, `topic create`, `subscribe`, `publish` (and its JSON input);
- `inspect`: `status`, `members`, `breaker`, `dead`, `check`;
- `admin`: `requeue`, `purge`, `show`, `audit`;
- `grant`: `grant` (least-privilege roles);
- `consume`: `consume`, its exit codes and signal handlers;
- `server`: `server status`, `server stop`;
- `demo`: `demo`, whose narration it prints;
- `web`: `web`, the dashboard (`pgq.web`, the `web` extra).

Command modules import `base` (and `render`); nothing imports them but this
module, which registers their commands on the root group: the only place that
knows every command.
"""

from __future__ import annotations

from collections.abc import Sequence

from pgq.cli import admin, consume, demo, grant, inspect, server, setup, web
from pgq.cli.base import cli

__all__ = ["cli", "main"]

for _command in (
    setup.init,
    setup.topic,
    setup.subscribe,
    setup.publish,
    inspect.status,
    inspect.members,
    inspect.breaker,
    inspect.dead,
    inspect.check,
    admin.show_command,
    admin.requeue_command,
    admin.purge_command,
    admin.audit_command,
    grant.grant_command,
    consume.consume,
    server.server,
    demo.demo,
    web.web,
):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="pgq")
