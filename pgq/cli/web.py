"""`pgq web`: the dashboard over this database (the `web` extra).

Read-only unless `--admin`, which needs admin tokens, one per person
(`pgq.web.tokens`): `NAME:TOKEN` entries in `--tokens-file` or
`$PGQ_WEB_TOKENS`, or one token in `$PGQ_WEB_TOKEN` (the person `admin`); never
a token in a flag: flags show in `ps` and shell history. A weak token stops it
at start (exit 2). Listens on 127.0.0.1 unless
`--host` says otherwise. The database is read once before it listens, so a
bad DSN or a missing schema is one line and exit 2, not an error page later.
SIGTERM and SIGHUP stop it as Ctrl-C does: the requests in flight are answered,
then it exits 0 (`stopping_on_signals`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat

import click

from pgq.cli.base import State, bind_dashboard, pass_state, stopping_on_signals, web_extra
from pgq.cli.logs import report
from pgq.errors import UsageError
from pgq.monitor import status_all

__all__ = ["web"]

logger = logging.getLogger("pgq.cli")

MAX_TOKENS_FILE = 1 << 20
"""Bytes a tokens file may have (a line is about 100)."""


def _loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback (all of 127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_tokens(path: str | None) -> str | None:
    """The tokens file's text (a warning when others may read it), or None. At most
    `MAX_TOKENS_FILE` bytes are read: a file without end (`/dev/zero`) is one line,
    not all the memory there is; a pipe (`<(...)`) is read like a file."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(MAX_TOKENS_FILE + 1)
        if len(data) > MAX_TOKENS_FILE:
            raise UsageError(f"the tokens file {path!r} is larger than {MAX_TOKENS_FILE >> 20} MiB")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"cannot read the tokens file {path!r}: {reason}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("web tokens file readable by others path=%r (chmod 600 it)", path)
    return text


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: any free"
)
@click.option(
    "--admin",
    is_flag=True,
    help="allow requeue and purge (audited under their name) to whoever logs in with an"
    " admin token ($PGQ_WEB_TOKEN, $PGQ_WEB_TOKENS, --tokens-file)",
)
@click.option(
    "--tokens-file",
    type=click.Path(dir_okay=False),
    envvar="PGQ_WEB_TOKENS_FILE",
    help="with --admin: NAME:TOKEN lines, one person each",
)
@pass_state
def web(state: State, host: str, port: int, admin: bool, tokens_file: str | None) -> None:
    """The dashboard: groups, breaker timelines, members, dead letters, messages.

    Pages update themselves every 2 seconds. `/api/groups` and
    `/api/groups/GROUP` answer the JSON of `pgq status --json`; `/healthz`
    says whether the database answers; `/metrics` serves every group's numbers
    to Prometheus. Ctrl-C stops it.
    """
    web = web_extra()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # `[::1]`, as URLs write it (docs/defects.md)
    users = web.admin_tokens(os.environ, _read_tokens(tokens_file)) if admin else None
    settings = state.settings
    options = web.WebOptions(
        member_ttl=settings.breaker_member_ttl, max_refunds=settings.breaker_max_refunds
    )
    status_all(state.engine, member_ttl=options.member_ttl)
    server = bind_dashboard(state.engine, host, port, users=users, options=options)
    if not _loopback(host):
        logger.warning(
            "web listening beyond this machine host=%s: anyone who reaches it can read"
            " every group%s",
            host,
            " (and the token travels unencrypted: put TLS in front)" if admin else "",
        )
    mode = "admin" if admin else "read-only"
    try:
        with stopping_on_signals():
            report(
                f"pgq web: {server.url} ({mode}); Ctrl-C stops it",
                "pgq web listening; Ctrl-C stops it",
                url=server.url,
                mode=mode,
            )
            server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()  # stopped before it served (serve() closes it otherwise)
