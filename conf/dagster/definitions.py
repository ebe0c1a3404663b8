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

- `land_group` drains a group into a table of the same database, one row per
  message, exactly once: a transactional batch handler
  (`Consumer(..., batch_handler=..., transactional=True)`) inserts each batch's
  rows in the transaction that commits the batch's acknowledgements, so a crash,
  a cancel or a lost lease can leave neither a row without its ack nor an ack
  without its row. A row the table refuses fails that message alone
  (`pgq.PartialFailure`); the others of its batch land.

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
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

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
    def engine(self) -> Iterator[sa.Engine]:
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


class MemberConfig(dg.Config):
    """A member that drains `group`, then stops.

    `wait_retries`: also wait for retries that come due within this many seconds
    (`--wait-retries`). `settings`: keyword settings over the resource's file and
    `PGQ_*` variables (`workers`, `lease`, `batch_size`, `breaker_min_members`, ...).
    `retry_wait` / `max_retries`: Dagster's retry when a breaker is open or the
    database stayed unreachable (exit 75 for the CLI).
    """

    group: str
    wait_retries: float = 0.0
    settings: dict[str, Any] | None = None
    retry_wait: float = 60.0
    max_retries: int = 10


class DrainConfig(MemberConfig):
    """`group` drained with `handler` (`MODULE:FUNCTION`, as `pgq consume --handler`)."""

    handler: str


class LandConfig(MemberConfig):
    """`group`'s messages landed in `table` (in `table_schema`; None: the search path),
    created if missing: `message_id` (the primary key), `topic`, `key`, `payload`
    (jsonb), `created_at` (the message's), `landed_at` (the commit's transaction).
    At most `batch_size` messages (a setting, default 100) per transaction."""

    table: str
    table_schema: str | None = None


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


def run_member(
    context: dg.OpExecutionContext, config: MemberConfig, consumer: pgq.Consumer
) -> dict[str, Any]:
    """Run `consumer` until the group is empty; an outage or an open breaker is
    Dagster's retry (exit 75 for the CLI). Returns the run's summary."""
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
        return run_member(context, config, consumer)


def landing_table(name: str, schema: str | None = None) -> sa.Table:
    """The table `land_group` writes: one row per message."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("message_id", sa.BigInteger, primary_key=True),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.Text),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "landed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        schema=schema,
    )


REFUSED = (sa.exc.IntegrityError, sa.exc.DataError)
"""What the table says of a row it will not take (a constraint, a bad value): that
message's failure alone. A lost connection or a timeout fails the whole batch."""


def land_batch(table: sa.Table) -> Any:
    """The transactional batch handler: insert the batch's rows with one statement in
    pgq's transaction (no commit: pgq commits them with the batch's acks). When the
    table refuses a row, each row is tried in its own savepoint to find the ones it
    refuses; `PartialFailure` then fails those and every write rolls back: the others
    run again, uncharged, in a later batch."""

    def rows(msgs: list[pgq.Message]) -> list[dict[str, Any]]:
        return [
            {
                "message_id": m.id,
                "topic": m.topic,
                "key": m.key,
                "payload": m.payload,
                "created_at": m.created_at,
            }
            for m in msgs
        ]

    def land(msgs: list[pgq.Message], conn: sa.Connection) -> None:
        try:
            with conn.begin_nested():
                conn.execute(sa.insert(table), rows(msgs))
            return
        except REFUSED as exc:
            batch_refused = exc
        refused: dict[int, BaseException] = {}
        for m in msgs:
            try:
                with conn.begin_nested():
                    conn.execute(sa.insert(table), rows([m]))
            except REFUSED as exc:
                refused[m.id] = exc
        if not refused:  # refused together, taken one by one: the batch fails as a whole
            raise batch_refused
        raise pgq.PartialFailure(refused)

    return land


@dg.op(ins={"after": dg.In(dg.Nothing)})
def land_group(
    context: dg.OpExecutionContext, config: LandConfig, queue: PgqResource
) -> dict[str, Any]:
    """Land what the group has ready in `config.table`, each message's row exactly
    once, then stop; retry later while a breaker is open."""
    table = landing_table(config.table, config.table_schema)
    settings = queue.settings(config.settings or {})
    with queue.engine() as engine:
        table.create(engine, checkfirst=True)
        consumer = pgq.Consumer(
            engine,
            config.group,
            batch_handler=land_batch(table),
            transactional=True,
            settings=settings,
            name=f"dagster:{context.run_id}",
        )
        return run_member(context, config, consumer)


@dg.job(description="Publish a batch in one transaction, then drain the group.")
def publish_and_drain() -> None:
    drain_group(after=publish_batch())


@dg.job(description="Drain the group (batch mode), as the cron entry does.")
def drain() -> None:
    drain_group()


@dg.job(description="Land the group's messages in a table, each exactly once.")
def land() -> None:
    land_group()


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
    jobs=[publish_and_drain, drain, land],
    schedules=[drain_every_5_minutes],
    resources={"queue": PgqResource(dsn=dg.EnvVar("PGQ_DSN"))},
)
