"""The orchestrator examples in conf/dagster and conf/airflow, run against the test database.

Dagster's job runs in-process (`execute_in_process`): the publish op writes its whole
batch in one transaction (a failure half-way publishes nothing), the drain op drains
the group, an open breaker becomes Dagster's retry (what exit 75 is for cron), a
cancelled run leaves no row leased, and the land op (a transactional batch handler)
writes each message's row into a table exactly once, a refused row failing alone.
The Airflow DAG's test runs only where Airflow is installed (it is not in the test
extra: too heavy).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import dagster as dg
import pytest
import sqlalchemy
import yaml
from fixtures.database import with_dbname
from helpers import wait_until
from sqlalchemy import Engine

import pgq

CONF = Path(__file__).resolve().parents[2] / "conf"

FAST = {"workers": 2, "poll_interval": 0.1, "lease": 5, "breaker_heartbeat": 0.2}
"""Consumer settings that keep a drain quick."""


def load_conf(name: str, path: Path) -> ModuleType:
    """Import a file under conf/ as module `name` (conf/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dagster_defs() -> ModuleType:
    return load_conf("pgq_dagster_definitions", CONF / "dagster" / "definitions.py")


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """An ephemeral Dagster instance with conf/dagster/dagster.yaml's logging settings.

    Those settings set the `pgq` logger's level: it is put back afterwards.
    """
    settings = yaml.safe_load((CONF / "dagster" / "dagster.yaml").read_text())
    level = logging.getLogger("pgq").level
    with dg.DagsterInstance.ephemeral(settings=settings) as inst:
        yield inst
    logging.getLogger("pgq").setLevel(level)


@pytest.fixture
def group(engine: Engine) -> str:
    pgq.create_topic(engine, "t")
    pgq.subscribe(engine, "g", "t")
    return "g"


def execute(
    defs: ModuleType,
    job: str,
    instance: dg.DagsterInstance,
    pg_dsn: str,
    schema: str,
    *,
    publish: dict[str, Any] | None = None,
    drain: dict[str, Any] | None = None,
    run_id: str | None = None,
) -> dg.ExecuteInProcessResult:
    ops: dict[str, Any] = {}
    if publish is not None:
        ops["publish_batch"] = {"config": {"topic": "t", **publish}}
    if drain is not None:
        ops["drain_group"] = {
            "config": {"group": "g", "handler": f"{__name__}:ok", "settings": FAST, **drain}
        }
    result: dg.ExecuteInProcessResult = getattr(defs, job).execute_in_process(
        run_config={"ops": ops},
        resources={"queue": defs.PgqResource(dsn=pg_dsn, pgq_schema=schema)},
        instance=instance,
        raise_on_error=False,
        run_id=run_id,
    )
    return result


def step_events(result: dg.ExecuteInProcessResult, step: str) -> list[str]:
    return [e.event_type_value for e in result.all_events if e.step_key == step]


def ok(msg: pgq.Message) -> None:
    """Handle a message successfully."""


def message_count(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(f'SELECT count(*) FROM "{schema}".message').scalar_one())


def test_publish_then_drain(dagster_defs, instance, engine, group, pg_dsn, schema):
    result = execute(
        dagster_defs,
        "publish_and_drain",
        instance,
        pg_dsn,
        schema,
        publish={"messages": [{"i": i} for i in range(25)], "chunk_size": 10},
        drain={},
    )
    assert result.success
    assert len(result.output_for_node("publish_batch")) == 25
    summary = result.output_for_node("drain_group")
    assert summary["done"] == 25 and summary["stop_reason"] == "empty"
    s = pgq.status(engine, group)
    assert s["counts"] == {"ready": 0, "leased": 0, "done": 25, "dead": 0, "dead_systemic": 0}
    # conf/dagster/dagster.yaml brings pgq's own log lines into the run's event log
    logged = [
        e.user_message for e in instance.all_logs(result.run_id) if e.is_dagster_event is False
    ]
    assert any(m.startswith("member joined group=g") for m in logged), logged
    assert any(m.startswith("member left group=g") for m in logged), logged


def test_publish_failing_half_way_publishes_nothing(
    dagster_defs, instance, engine, group, pg_dsn, schema
):
    messages: list[Any] = [{"i": i} for i in range(9)]
    messages[6] = {"i": "\u0000"}  # PostgreSQL's jsonb refuses it: the third chunk fails
    result = execute(
        dagster_defs,
        "publish_and_drain",
        instance,
        pg_dsn,
        schema,
        publish={"messages": messages, "chunk_size": 3},
        drain={},
    )
    assert not result.success
    assert "STEP_FAILURE" in step_events(result, "publish_batch")
    assert "STEP_START" not in step_events(result, "drain_group")
    assert message_count(engine, schema) == 0  # the first two chunks were rolled back
    assert pgq.status(engine, group)["lag"] == 0


def open_breaker(engine: Engine, schema: str) -> None:
    """The group's breaker OPEN, its next probe an hour away (as an outage leaves it)."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"UPDATE \"{schema}\".breaker SET state = 'OPEN', epoch = 1,"
            " next_probe_at = now() + interval '1 hour'"
        )


def test_open_breaker_requests_a_retry(dagster_defs, instance, engine, group, pg_dsn, schema):
    pgq.publish_many(engine, "t", [{"i": i} for i in range(10)])
    open_breaker(engine, schema)
    result = execute(
        dagster_defs,
        "drain",
        instance,
        pg_dsn,
        schema,
        drain={"max_retries": 1, "retry_wait": 0.1},
    )
    events = [e for e in result.all_events if e.step_key == "drain_group"]
    kinds = [e.event_type_value for e in events]
    assert kinds.count("STEP_UP_FOR_RETRY") == 1, kinds
    assert "STEP_RESTARTED" in kinds and "STEP_SUCCESS" not in kinds
    retry = next(e for e in events if e.event_type_value == "STEP_UP_FOR_RETRY")
    assert retry.step_retry_data.seconds_to_wait == 0.1
    assert retry.step_retry_data.error.cls_name == "RetryRequested"
    # the retry budget spent on a breaker that stays open, the step fails
    assert kinds[-1] == "STEP_FAILURE" and not result.success
    s = pgq.status(engine, group)
    assert s["breaker"]["state"] == "OPEN"
    assert s["counts"]["ready"] == 10 and s["counts"]["leased"] == 0


def test_unreachable_database_retries_and_a_missing_database_fails(dagster_defs, instance, pg_dsn):
    """Exit 75 (the database stayed away for `lease` seconds) is a retry; exit 2 (a
    database the server refuses: configuration) fails at once."""
    drain = {"group": "g", "handler": f"{__name__}:ok", "max_retries": 1, "retry_wait": 0.1}
    drain["settings"] = {**FAST, "lease": 1}
    cases = {
        "postgresql://postgres@127.0.0.1:9/postgres?connect_timeout=1": (1, "DatabaseUnavailable"),
        with_dbname(pg_dsn, f"pgq_missing_{uuid.uuid4().hex[:8]}"): (0, "BadDsn"),
    }
    for dsn, (retries, cause) in cases.items():
        result = dagster_defs.drain.execute_in_process(
            run_config={"ops": {"drain_group": {"config": drain}}},
            resources={"queue": dagster_defs.PgqResource(dsn=dsn)},
            instance=instance,
            raise_on_error=False,
        )
        kinds = step_events(result, "drain_group")
        assert kinds.count("STEP_UP_FOR_RETRY") == retries, (dsn, kinds)
        assert kinds[-1] == "STEP_FAILURE"
        failure = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"][-1]
        error = failure.step_failure_data.error
        assert error is not None and error.cause is not None
        assert error.cause.cls_name == cause, (dsn, error.cause.cls_name)


def landed(engine: Engine, schema: str, table: str = "landed") -> list[tuple[int, Any]]:
    """The landing table's (message_id, payload) rows, by message id."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f'SELECT message_id, payload FROM "{schema}"."{table}" ORDER BY message_id'
        ).all()
    return [(int(i), p) for i, p in rows]


def published(engine: Engine, schema: str) -> list[tuple[int, Any]]:
    """The topic's messages (id, payload) still in the table, by id."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f'SELECT id, payload FROM "{schema}".message ORDER BY id').all()
    return [(int(i), p) for i, p in rows]


def land(
    defs: ModuleType,
    instance: dg.DagsterInstance,
    pg_dsn: str,
    schema: str,
    **settings: Any,
) -> dg.ExecuteInProcessResult:
    config = {"group": "g", "table": "landed", "table_schema": schema}
    result: dg.ExecuteInProcessResult = defs.land.execute_in_process(
        run_config={
            "ops": {"land_group": {"config": {**config, "settings": {**FAST, **settings}}}}
        },
        resources={"queue": defs.PgqResource(dsn=pg_dsn, pgq_schema=schema)},
        instance=instance,
        raise_on_error=False,
    )
    return result


def test_land_writes_each_message_once_with_its_ack(
    dagster_defs, instance, engine, group, pg_dsn, schema
):
    """The transactional batch handler's job: every message's row in the table once,
    committed with its ack; a second run lands nothing more."""
    pgq.publish_many(engine, "t", [{"i": i} for i in range(47)])
    messages = published(engine, schema)  # before the acks delete them
    result = land(dagster_defs, instance, pg_dsn, schema, batch_size=10)
    assert result.success
    summary = result.output_for_node("land_group")
    assert summary["done"] == 47 and summary["stop_reason"] == "empty"
    assert landed(engine, schema) == messages
    s = pgq.status(engine, group)
    assert s["counts"] == {"ready": 0, "leased": 0, "done": 47, "dead": 0, "dead_systemic": 0}
    pgq.publish_many(engine, "t", [{"i": i} for i in range(47, 50)])
    messages += published(engine, schema)[-3:]
    again = land(dagster_defs, instance, pg_dsn, schema)
    assert again.success and again.output_for_node("land_group")["done"] == 3
    assert landed(engine, schema) == messages


def test_land_fails_only_the_row_the_table_refuses(
    dagster_defs, instance, engine, group, pg_dsn, schema
):
    """A row the table refuses (here a CHECK the user added) fails its message alone
    (`PartialFailure`): its batch-mates land, uncharged; nothing lands twice."""
    table = dagster_defs.landing_table("landed", schema)
    table.append_constraint(sqlalchemy.CheckConstraint("payload->>'i' <> '13'"))
    table.create(engine)
    pgq.publish_many(engine, "t", [{"i": i} for i in range(30)])
    messages = published(engine, schema)
    refused = messages[13][0]
    result = land(dagster_defs, instance, pg_dsn, schema, batch_size=10, max_attempts=1)
    assert result.success
    assert landed(engine, schema) == [m for m in messages if m[0] != refused]
    # max_attempts=1: a batch-mate charged for the refused row would be dead too
    s = pgq.status(engine, group)
    assert s["counts"] == {"ready": 0, "leased": 0, "done": 29, "dead": 1, "dead_systemic": 0}
    with engine.connect() as conn:
        dead = conn.exec_driver_sql(
            f"SELECT message_id, attempts, error_class, last_error"
            f" FROM \"{schema}\".delivery WHERE state = 'dead'"
        ).all()
    assert [(int(i), a, c) for i, a, c, _ in dead] == [(refused, 1, "message")]
    assert "landed_check" in dead[0][3] or "check constraint" in dead[0][3], dead[0][3]


def test_cancelled_land_leaves_table_and_group_agreeing(
    dagster_defs, instance, engine, group, pg_dsn, schema
):
    """A land run cancelled mid-way (Dagster's Terminate: SIGINT in the op) stops with
    every acknowledged message's row in the table and no other; the next run lands
    the rest, nothing twice."""
    assert threading.current_thread() is threading.main_thread()  # signals reach this thread
    dagster_defs.landing_table("landed", schema).create(engine)
    with engine.begin() as conn:  # each row takes a while: the cancel comes mid-run
        conn.exec_driver_sql(
            f'CREATE FUNCTION "{schema}".slow() RETURNS trigger LANGUAGE plpgsql AS'
            " $$BEGIN PERFORM pg_sleep(0.01); RETURN NEW; END$$;"
            f' CREATE TRIGGER slow BEFORE INSERT ON "{schema}".landed'
            f' FOR EACH ROW EXECUTE FUNCTION "{schema}".slow()'
        )
    pgq.publish_many(engine, "t", [{"i": i} for i in range(200)])
    messages = published(engine, schema)
    run_id = str(uuid.uuid4())

    def cancel_once_some_landed() -> None:
        wait_until(lambda: landed(engine, schema), 30, "a first batch lands")
        run = instance.get_run_by_id(run_id)
        assert run is not None
        instance.report_run_canceling(run)
        os.kill(os.getpid(), signal.SIGINT)

    canceller = threading.Thread(target=cancel_once_some_landed)
    canceller.start()
    try:
        result = dagster_defs.land.execute_in_process(
            run_config={
                "ops": {
                    "land_group": {
                        "config": {
                            "group": "g",
                            "table": "landed",
                            "table_schema": schema,
                            "settings": {**FAST, "batch_size": 10, "prefetch": 10},
                        }
                    }
                }
            },
            resources={"queue": dagster_defs.PgqResource(dsn=pg_dsn, pgq_schema=schema)},
            instance=instance,
            raise_on_error=False,
            run_id=run_id,
        )
    finally:
        canceller.join(30)
    assert result.dagster_run.status == dg.DagsterRunStatus.CANCELED
    s = pgq.status(engine, group)
    assert s["counts"]["leased"] == 0 and s["counts"]["dead"] == 0
    assert 0 < s["counts"]["done"] < 200, s["counts"]
    with engine.connect() as conn:
        waiting = {
            int(i)
            for (i,) in conn.exec_driver_sql(
                f"SELECT message_id FROM \"{schema}\".delivery WHERE state <> 'done'"
            )
        }
    # acknowledged (no delivery row left) exactly when its row landed
    assert landed(engine, schema) == [m for m in messages if m[0] not in waiting]
    assert len(waiting) == s["counts"]["ready"]
    again = land(dagster_defs, instance, pg_dsn, schema)
    assert again.success
    assert landed(engine, schema) == messages


CANCEL: dict[str, Any] = {}
"""What `cancel_run` needs: the Dagster instance, the run id, the engine and the group."""


def cancel_run(msg: pgq.Message) -> None:
    """At the first message, cancel the Dagster run as the UI's Terminate does.

    The run is marked CANCELING, then its process interrupts its own main thread
    with SIGINT (Dagster's `send_interrupt()`, from the run worker's termination or
    cancellation thread). Inside an op that raises `DagsterExecutionInterruptedError`
    in `Consumer.run`. This handler then waits until the member has handed back the
    rows no worker started (only its own row is still leased), and finishes.
    """
    first = CANCEL.pop("first", None)
    if first is None:
        return
    inst: dg.DagsterInstance = CANCEL["instance"]
    run = inst.get_run_by_id(CANCEL["run_id"])
    assert run is not None
    inst.report_run_canceling(run)
    os.kill(os.getpid(), signal.SIGINT)
    wait_until(
        lambda: pgq.status(CANCEL["engine"], "g")["counts"]["leased"] == 1,
        10,
        "the interrupted member hands back the rows no worker started",
    )


def test_cancelled_run_leaves_no_row_leased(dagster_defs, instance, engine, group, pg_dsn, schema):
    assert threading.current_thread() is threading.main_thread()  # signals reach this thread
    pgq.publish_many(engine, "t", [{"i": i} for i in range(40)])
    run_id = str(uuid.uuid4())
    CANCEL.update(first=True, instance=instance, run_id=run_id, engine=engine)
    try:
        result = execute(
            dagster_defs,
            "drain",
            instance,
            pg_dsn,
            schema,
            drain={
                "handler": f"{__name__}:cancel_run",
                "settings": {**FAST, "workers": 1, "batch_size": 4, "prefetch": 4},
            },
            run_id=run_id,
        )
    finally:
        CANCEL.clear()
    assert "STEP_FAILURE" in step_events(result, "drain_group")
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_failure_data.error.cls_name == "DagsterExecutionInterruptedError"
    assert result.dagster_run.status == dg.DagsterRunStatus.CANCELED
    s = pgq.status(engine, group)
    # the handler's row finished; the rows claimed but not started went back at once
    assert s["counts"] == {"ready": 39, "leased": 0, "done": 1, "dead": 0, "dead_systemic": 0}
    assert s["totals"]["released"] >= 1
    assert [m for m in s["members"] if m["live"]] == []


@pytest.fixture
def airflow_dags(pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """conf/airflow/pgq_dags.py with its workers' environment pointed at the test schema;
    skips where Airflow is not installed."""
    pytest.importorskip("airflow.sdk")
    monkeypatch.setenv("PGQ_DSN", pg_dsn)
    monkeypatch.setenv("PGQ_SCHEMA", schema)
    return load_conf("pgq_airflow_dags", CONF / "airflow" / "pgq_dags.py")


def test_airflow_publish_and_drain(airflow_dags, engine, group, schema):
    from airflow.sdk.exceptions import AirflowFailException

    dag = airflow_dags.publish_and_drain
    assert dag.get_task("drain_group").upstream_task_ids == {"publish_batch"}
    assert dag.get_task("drain_group").retries == 12
    bad: list[Any] = [{"i": i} for i in range(9)]
    bad[6] = {"i": "\u0000"}
    with pytest.raises(AirflowFailException):  # a payload PostgreSQL refuses: no retry
        airflow_dags.publish_batch("t", bad, chunk_size=3)
    assert message_count(engine, schema) == 0
    assert len(airflow_dags.publish_batch("t", [{"i": i} for i in range(20)], chunk_size=6)) == 20
    drain = airflow_dags.DrainGroupOperator(
        task_id="drain_group", group="g", handler=f"{__name__}:ok", settings=FAST
    )
    assert drain.execute({"run_id": "manual__1"})["done"] == 20
    assert pgq.status(engine, group)["counts"]["done"] == 20


def test_airflow_open_breaker_is_a_retry(airflow_dags, engine, group, schema):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

    pgq.publish_many(engine, "t", [{"i": i} for i in range(5)])
    open_breaker(engine, schema)
    drain = airflow_dags.DrainGroupOperator(
        task_id="drain_group", group="g", handler=f"{__name__}:ok", settings=FAST
    )
    with pytest.raises(AirflowException) as raised:
        drain.execute({"run_id": "manual__1"})
    assert isinstance(raised.value, airflow_dags.TryLater)  # retries / retry_delay apply
    assert not isinstance(raised.value, AirflowFailException | AirflowSkipException)
    assert pgq.status(engine, group)["counts"]["ready"] == 5


KILL: dict[str, Any] = {}
"""What `kill_task` needs: the engine."""


def kill_task(msg: pgq.Message) -> None:
    """At the first message, send the task process SIGTERM, as Airflow 3's supervisor
    does to a task marked failed or cleared; then wait until the member has handed
    back the rows no worker started, and finish."""
    if KILL.pop("first", None) is None:
        return
    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(
        lambda: pgq.status(KILL["engine"], "g")["counts"]["leased"] == 1,
        10,
        "the killed member hands back the rows no worker started",
    )


def test_airflow_killed_task_leaves_no_row_leased(airflow_dags, engine, group):
    from airflow.sdk.exceptions import AirflowException

    pgq.publish_many(engine, "t", [{"i": i} for i in range(40)])
    drain = airflow_dags.DrainGroupOperator(
        task_id="drain_group",
        group="g",
        handler=f"{__name__}:kill_task",
        settings={**FAST, "workers": 1, "batch_size": 4, "prefetch": 4},
    )

    def on_term(signum: int, frame: object) -> None:  # Airflow's task runner: ti.task.on_kill()
        drain.on_kill()

    previous = signal.signal(signal.SIGTERM, on_term)
    KILL.update(first=True, engine=engine)
    try:
        with pytest.raises(AirflowException, match="stopped"):
            drain.execute({"run_id": "manual__1"})
    finally:
        signal.signal(signal.SIGTERM, previous)
        KILL.clear()
    s = pgq.status(engine, group)
    assert s["counts"] == {"ready": 39, "leased": 0, "done": 1, "dead": 0, "dead_systemic": 0}
