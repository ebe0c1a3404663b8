"""`pgq consume`: run one member of a group from the command line.

Exit codes (DESIGN §7): 0 when it finished what it was asked (drained with
`--until-empty`, reached a limit, or stopped by SIGTERM/SIGINT/SIGHUP after a
clean shutdown, or before it claimed anything); 75 when `--until-empty` stopped
because a breaker is open (or the database could not be reached within `lease`
seconds); 2 on bad usage or configuration, a refused login or a missing
database included (at once, never retried); 1 otherwise (a second signal,
handlers that overran the grace).

The settings are built once here, in the CLI's layers (the config file, then
`PGQ_*` variables, then the flags), and handed to `Consumer` as one object.
This is the only place that installs signal handlers for a member (`pgq web` and
`pgq demo` turn SIGTERM and SIGHUP into Ctrl-C: `base.stopping_on_signals`;
before a command takes over, `startup.hold` stops the process cleanly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from types import FrameType

import click

from pgq.cli import startup
from pgq.cli.base import State, pass_state
from pgq.cli.logs import report
from pgq.consumer import Consumer
from pgq.consumer.handling import load_handler
from pgq.errors import DatabaseUnavailable
from pgq.logcontext import get_logger
from pgq.settings import load_settings, parse_duration

__all__ = ["EX_TEMPFAIL", "consume", "install_signal_handlers", "load_handler"]

logger = get_logger("pgq.cli")

EX_TEMPFAIL = 75
"""Exit code when `--until-empty` stopped because a breaker is open (sysexits EX_TEMPFAIL)."""


def _duration(value: str | None, flag: str, *, zero: bool = False) -> float | None:
    """A duration flag's seconds (None when not given); `zero`: 0 is allowed."""
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None
    if seconds < 0 or (seconds == 0 and not zero):
        raise click.BadParameter("must be >= 0" if zero else "must be > 0", param_hint=flag)
    return seconds


def install_signal_handlers(consumer: Consumer) -> None:
    """First SIGTERM/SIGINT/SIGHUP: graceful stop. Second: release what we can, exit 1.

    They replace `startup.hold`'s, which stopped the process before anything was
    claimed; SIGHUP (a closed terminal, a service manager) stops like SIGTERM."""
    count = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal count
        count += 1
        if count == 1:
            logger.info(
                "stopping on signal=%s (again to exit at once)", signal.Signals(signum).name
            )
            consumer.request_stop("signal")
            return
        logger.warning("second signal: releasing unstarted rows and exiting")
        consumer.abort()
        os._exit(1)

    for s in startup.STOP_SIGNALS:
        signal.signal(s, on_signal)


@click.command()
@click.argument("group")
@click.option(
    "--handler", "handler_path", required=True, help="MODULE:FUNCTION to call per message"
)
@click.option("--workers", type=click.IntRange(1), help="worker threads (default 8)")
@click.option("--until-empty", is_flag=True, help="stop once the group has nothing ready")
@click.option(
    "--wait-retries",
    help="with --until-empty: also wait for retries due within this long (seconds or 5m...)",
)
@click.option("--max-messages", type=click.IntRange(1), help="stop after N finished attempts")
@click.option("--max-runtime", help="stop gracefully after this long (seconds or 5m, 1h...)")
@click.option("--name", help="member name (default host:pid:random)")
@click.option("--metrics-port", type=click.IntRange(1, 65535), help="serve Prometheus metrics")
@click.option(
    "--metrics-host",
    help="with --metrics-port: the address to serve them on (default 127.0.0.1)",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    envvar="PGQ_CONFIG",
    help="TOML config file ([consumer], [breaker])",
)
@pass_state
def consume(
    state: State,
    group: str,
    handler_path: str,
    workers: int | None,
    until_empty: bool,
    wait_retries: str | None,
    max_messages: int | None,
    max_runtime: str | None,
    name: str | None,
    metrics_port: int | None,
    metrics_host: str | None,
    config_file: str | None,
) -> None:
    """Run a member of GROUP, calling the handler for each message."""
    startup.stop_is_clean()  # until its own handlers are in, a stop claimed nothing
    runtime = _duration(max_runtime, "--max-runtime")
    retries = _duration(wait_retries, "--wait-retries", zero=True) or 0.0
    if wait_retries is not None and not until_empty:
        raise click.UsageError("--wait-retries needs --until-empty")
    if metrics_host is not None and metrics_port is None:
        raise click.UsageError("--metrics-host needs --metrics-port")
    settings = load_settings(
        config_file or state.config, env=os.environ, overrides={"workers": workers}
    )
    handler = load_handler(handler_path)
    consumer = Consumer(state.engine, group, handler, settings=settings, name=name)
    with contextlib.ExitStack() as serving:
        if metrics_port is not None:
            from pgq.metrics import DEFAULT_HOST, serving_metrics

            host = metrics_host or DEFAULT_HOST
            serving.enter_context(serving_metrics(metrics_port, consumer, host))
        install_signal_handlers(consumer)
        try:
            summary = consumer.run(
                until_empty=until_empty,
                max_messages=max_messages,
                max_runtime=runtime,
                wait_retries=retries,
            )
        except DatabaseUnavailable as exc:
            if until_empty:
                report(
                    f"pgq: database unavailable, try later: {exc}",
                    "database unavailable, try later",
                    level="ERROR",
                    error=str(exc),
                    group=group,
                    member=consumer.name,
                    exit_code=EX_TEMPFAIL,
                )
                sys.exit(EX_TEMPFAIL)
            raise
    report(
        f"handled={summary.handled} done={summary.done} retried={summary.retried} "
        f"dead={summary.dead} released={summary.released} reclaimed={summary.reclaimed} "
        f"waiting_retry={summary.waiting_retry} refused={summary.refused}"
        f" stop_reason={summary.stop_reason}",
        "run summary",
        group=group,
        member=consumer.name,
        **dataclasses.asdict(summary),
    )
    if summary.stop_reason == "breaker_open":
        sys.exit(EX_TEMPFAIL)
    if not consumer.clean:
        sys.exit(1)
