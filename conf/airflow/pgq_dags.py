"""pgq under Airflow 3: publish a batch in one transaction, then drain a consumer group.

Copy this file into your DAGs folder; the workers need pgq installed and `PGQ_DSN`
(and `PGQ_SCHEMA`, `PGQ_CONFIG`, `PGQ_<KEY>` settings as for `pgq consume`) in their
environment. Two DAGs, as the cron entry and the systemd unit beside this directory
run pgq:

- `pgq_publish_and_drain` (triggered with params): `publish_batch` publishes every
  message in ONE transaction (a failure anywhere publishes nothing), then
  `drain_group` runs a member in batch mode, `Consumer.run(until_empty=True)`.
- `pgq_drain` drains a group every 5 minutes, the twin of conf/pgq.cron (paused
  when first loaded).

Where `pgq consume --until-empty` exits 75 (a breaker is open, or the database
stayed away: try later), `drain_group` raises `TryLater`, an `AirflowException`:
the task goes `up_for_retry` and the task's `retries` / `retry_delay` apply. Bad
configuration (exit 2 for the CLI: unknown group, refused login, missing
privilege, bad handler) raises `AirflowFailException`: no retry can fix it. See
README.md beside this file.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow.sdk import DAG, BaseOperator, Param, task
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from sqlalchemy import Engine

import pgq

KILL_GRACE = 4.0
"""Seconds a killed drain lets running handlers finish: Airflow 3's supervisor sends
SIGKILL 5 s after the SIGTERM that runs `on_kill`."""

RETRIES = {
    "retries": 12,
    "retry_delay": dt.timedelta(seconds=30),
    "retry_exponential_backoff": True,
    "max_retry_delay": dt.timedelta(minutes=5),
}
"""Retry while a breaker stays open: 30 s doubling to 5 min (`probe_interval_max`), ~50 min."""


class TryLater(AirflowException):
    """The group's breaker, or the member's own, is open (or the database stayed
    unreachable for `lease` seconds): exit 75 for `pgq consume --until-empty`."""


@contextmanager
def pgq_engine() -> Iterator[Engine]:
    """An engine on `$PGQ_DSN` / `$PGQ_SCHEMA`, disposed of at the end of the task."""
    if not os.environ.get("PGQ_DSN"):
        # without it pgq would start an embedded server inside the worker
        raise AirflowFailException("set PGQ_DSN in the workers' environment")
    engine = pgq.connect()
    try:
        yield engine
    finally:
        engine.dispose()


def publish_batch(topic: str, messages: list[Any], chunk_size: int = 1000) -> list[int]:
    """Publish `messages` to `topic` in one transaction: every one, or none.

    `chunk_size` bounds one statement; the chunks share the transaction. A payload
    or name pgq refuses fails the task without retry.
    """
    if chunk_size < 1:
        raise AirflowFailException("chunk_size must be >= 1")
    ids: list[int] = []
    try:
        with pgq_engine() as engine, engine.begin() as conn:
            for start in range(0, len(messages), chunk_size):
                chunk = messages[start : start + chunk_size]
                ids += pgq.publish_many(conn, topic, chunk)
    except pgq.UsageError as exc:
        raise AirflowFailException(str(exc)) from exc
    return ids


class DrainGroupOperator(BaseOperator):
    """Drain `group` with `handler` (`MODULE:FUNCTION`) in batch mode, then stop.

    `wait_retries`: also wait for retries due within this many seconds
    (`--wait-retries`). `settings`: keyword settings over `$PGQ_CONFIG` and the
    `PGQ_*` variables. Returns the run's summary (an XCom).
    """

    template_fields = ("group", "handler")

    def __init__(
        self,
        *,
        group: str,
        handler: str,
        wait_retries: float = 0.0,
        settings: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.group = group
        self.handler = handler
        self.wait_retries = wait_retries
        self.settings = dict(settings or {})
        self._consumer: pgq.Consumer | None = None

    def execute(self, context: Any) -> dict[str, Any]:
        try:
            handler = pgq.load_handler(self.handler)
            settings = pgq.load_settings(
                os.environ.get("PGQ_CONFIG"), env=os.environ, overrides=self.settings
            )
            with pgq_engine() as engine:
                self._consumer = pgq.Consumer(
                    engine,
                    self.group,
                    handler,
                    settings=settings,
                    name=f"airflow:{context['run_id']}",
                )
                summary = self._consumer.run(until_empty=True, wait_retries=self.wait_retries)
        except pgq.DatabaseUnavailable as exc:  # an outage: try later
            raise TryLater(f"database unavailable: {exc}") from exc
        except pgq.UsageError as exc:  # configuration, a refused login or missing database too
            raise AirflowFailException(str(exc)) from exc
        counts = dataclasses.asdict(summary)
        self.log.info(
            "drained group=%s %s", self.group, " ".join(f"{k}={v}" for k, v in counts.items())
        )
        if summary.stop_reason == "breaker_open":
            raise TryLater(f"breaker open for group {self.group!r}: retrying later")
        if summary.stop_reason == "signal":
            raise AirflowException("the drain was stopped (task killed)")
        if not self._consumer.clean:
            raise AirflowException("handlers were still running when shutdown_grace ended")
        return counts

    def on_kill(self) -> None:
        """Airflow kills the task (marked failed, cleared, worker shutdown): stop the
        member as SIGTERM stops `pgq consume` (rows no worker started go back to the
        group at once), letting running handlers finish within `KILL_GRACE`."""
        consumer = self._consumer
        if consumer is None:
            return
        if consumer.started:
            consumer.stop(timeout=KILL_GRACE)
        else:
            consumer.request_stop()


with DAG(
    dag_id="pgq_publish_and_drain",
    description="Publish a batch in one transaction, then drain the group",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    catchup=False,
    max_active_runs=1,
    default_args=RETRIES,
    params={
        "topic": Param("orders", type="string"),
        "messages": Param([], type="array"),
        "group": Param("billing", type="string"),
        "handler": Param("myapp.consumers:handle", type="string"),
    },
) as publish_and_drain:

    @task(task_id="publish_batch")
    def publish(params: dict[str, Any] | None = None) -> list[int]:
        assert params is not None
        return publish_batch(params["topic"], params["messages"])

    publish() >> DrainGroupOperator(
        task_id="drain_group", group="{{ params.group }}", handler="{{ params.handler }}"
    )


with DAG(
    dag_id="pgq_drain",
    description="Drain the group every 5 minutes (batch mode), as conf/pgq.cron does",
    schedule="*/5 * * * *",
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=True,
    default_args=RETRIES,
) as drain:
    DrainGroupOperator(task_id="drain_group", group="billing", handler="myapp.consumers:handle")
