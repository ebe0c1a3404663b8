"""pgq under Dagster: publish a batch in one transaction, then drain a consumer group.

    PGQ_DSN=postgresql://pgq@db.example.internal/app dagster dev -f conf/dagster/definitions.py

Two ops, as the cron entry and the systemd unit beside this directory run pgq:

- `publish_batch` publishes every message of its batch in ONE transaction
  (`pgq.publish_many` on a `Connection` inside `engine.begin()`): a failure
  anywhere in the batch publishes nothing.
- `drain_group` runs a member in batch mode, `Consumer.run(until_empty=True)`,
  the library twin of `pgq consume --until-empty`. Where that command exits 75
  ("a breaker is open, or the database stayed away: try later"), this op raises
  `RetryRequested`: the step is retried after `retry_wait` seconds, up to
  `max_retries` times, and only then fails. Bad configuration (unknown group,
  refused login, missing privilege: exit 2 for the CLI) fails at once.

Cancelling a run (the UI's Terminate, `dagster run terminate`) interrupts the op
with `DagsterExecutionInterruptedError`; `Consumer.run` then shuts the member
down as SIGTERM would (rows no worker started go back to the group, running
handlers finish within `shutdown_grace`) before the step ends. See README.md.
"""

# No `from __future__ import annotations`: Dagster reads the ops' annotations at run time.
import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from sqlalchemy import Engine

import pgq


class PgqResource(dg.ConfigurableResource):
    """Where the queue lives.

    `dsn`: a libpq URL or key=value string (bind it to `EnvVar("PGQ_DSN")` so the
    password never shows in the UI). `pgq_schema`: the schema (None: `$PGQ_SCHEMA`,
    else `pgq`). `config_file`: a pgq TOML file (`[consumer]`, `[breaker]`); as
    for `pgq consume`, `PGQ_<KEY>` / `PGQ_BREAKER_<KEY>` variables override it.
    """

    dsn: str
    pgq_schema: str | None = None
    config_file: str | None = None

    @contextmanager
    def engine(self) -> Iterator[Engine]:
        """An engine for one op, disposed of when the op ends."""
        engine = pgq.connect(self.dsn, schema=self.pgq_schema)
        try:
            yield engine
        finally:
            engine.dispose()

    def settings(self, overrides: dict[str, Any]) -> pgq.Settings:
        """The consumer settings: defaults, the file, `PGQ_*` variables, then `overrides`."""
        return pgq.load_settings(self.config_file, env=os.environ, overrides=overrides)


class PublishConfig(dg.Config):
    """`messages`: JSON payloads, published to `topic` in one transaction.

    `chunk_size` bounds one statement; the chunks share the transaction.
    """

    topic: str
    messages: list[Any]
    key: str | None = None
    chunk_size: int = 1000


class DrainConfig(dg.Config):
    """`group` drained with `handler` (`MODULE:FUNCTION`, as `pgq consume --handler`).

    `wait_retries`: also wait for retries that come due within this many seconds
    (`--wait-retries`). `settings`: keyword settings over the resource's file and
    `PGQ_*` variables (`workers`, `lease`, `breaker_min_members`, ...).
    `retry_wait` / `max_retries`: Dagster's retry when a breaker is open or the
    database stayed unreachable (exit 75 for the CLI).
    """

    group: str
    handler: str
    wait_retries: float = 0.0
    settings: dict[str, Any] | None = None
    retry_wait: float = 60.0
    max_retries: int = 10


@dg.op
def publish_batch(
    context: dg.OpExecutionContext, config: PublishConfig, queue: PgqResource
) -> list[int]:
    """Publish the batch in one transaction: every message, or none. Returns the ids."""
    if config.chunk_size < 1:
        raise dg.Failure(description="chunk_size must be >= 1")
    ids: list[int] = []
    with queue.engine() as engine, engine.begin() as conn:
        for start in range(0, len(config.messages), config.chunk_size):
            chunk = config.messages[start : start + config.chunk_size]
            ids += pgq.publish_many(conn, config.topic, chunk, key=config.key)
    context.log.info("published topic=%s messages=%d", config.topic, len(ids))
    return ids


@dg.op(ins={"after": dg.In(dg.Nothing)})
def drain_group(
    context: dg.OpExecutionContext, config: DrainConfig, queue: PgqResource
) -> dict[str, Any]:
    """Handle what the group has ready, then stop; retry later while a breaker is open."""
    handler = pgq.load_handler(config.handler)
    settings = queue.settings(config.settings or {})
    with queue.engine() as engine:
        consumer = pgq.Consumer(
            engine, config.group, handler, settings=settings, name=f"dagster:{context.run_id}"
        )
        try:
            summary = consumer.run(until_empty=True, wait_retries=config.wait_retries)
        except pgq.DatabaseUnavailable as exc:
            # only an outage: a refused login or a missing database is a pgq.UsageError
            # (configuration, exit 2 for the CLI) and fails the op at once
            context.log.warning("database unavailable, retrying later error=%s", exc)
            raise dg.RetryRequested(
                max_retries=config.max_retries, seconds_to_wait=config.retry_wait
            ) from exc
    counts = dataclasses.asdict(summary)
    fields = " ".join(f"{k}={v}" for k, v in counts.items())
    context.log.info("drained group=%s %s", config.group, fields)
    if summary.stop_reason == "breaker_open":
        context.log.warning("breaker open, retrying later group=%s", config.group)
        raise dg.RetryRequested(max_retries=config.max_retries, seconds_to_wait=config.retry_wait)
    if not consumer.clean:
        raise dg.Failure(description="handlers were still running when shutdown_grace ended")
    context.add_output_metadata(counts)
    return counts


@dg.job(description="Publish a batch in one transaction, then drain the group.")
def publish_and_drain() -> None:
    drain_group(after=publish_batch())


@dg.job(description="Drain the group (batch mode), as the cron entry does.")
def drain() -> None:
    drain_group()


drain_every_5_minutes = dg.ScheduleDefinition(
    job=drain,
    cron_schedule="*/5 * * * *",
    run_config={
        "ops": {
            "drain_group": {"config": {"group": "billing", "handler": "myapp.consumers:handle"}}
        }
    },
    default_status=dg.DefaultScheduleStatus.STOPPED,
)

defs = dg.Definitions(
    jobs=[publish_and_drain, drain],
    schedules=[drain_every_5_minutes],
    resources={"queue": PgqResource(dsn=dg.EnvVar("PGQ_DSN"))},
)
