"""`Consumer` builds its settings once: a config file, keyword overrides, or a `Settings`."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from sqlalchemy import Engine

import pgq
from pgq.settings import DEFAULTS, Settings

# a value for every setting that differs from its default (and fits the relations)
NOT_DEFAULT: dict[str, object] = {
    "workers": 3,
    "batch_size": 7,
    "lease": 12.5,
    "max_attempts": 9,
    "max_reclaims": 4,
    "retry_backoff": 0.5,
    "retry_backoff_max": 40.0,
    "poll_interval": 0.25,
    "shutdown_grace": 6.0,
    "prefetch": 5,
    "handler_timeout": 44.0,
    "retention": 3600.0,
    "breaker_window": 11,
    "breaker_min_calls": 4,
    "breaker_failure_rate": 0.75,
    "breaker_open_for": 2.0,
    "breaker_open_for_max": 20.0,
    "breaker_heartbeat": 0.5,
    "breaker_member_ttl": 3.0,
    "breaker_member_retention": 7200.0,
    "breaker_quorum": 0.25,
    "breaker_min_members": 1,
    "breaker_probe_interval": 1.5,
    "breaker_probe_interval_max": 15.0,
    "breaker_max_refunds": 6,
    "breaker_prober_turns": 2,
}


def test_the_table_covers_every_setting():
    assert set(NOT_DEFAULT) == set(DEFAULTS)
    assert all(NOT_DEFAULT[k] != DEFAULTS[k] for k in DEFAULTS)


def _toml(values: dict[str, object]) -> str:
    consumer = {k: v for k, v in values.items() if not k.startswith("breaker_")}
    breaker = {k.removeprefix("breaker_"): v for k, v in values.items() if k.startswith("breaker_")}
    lines = ["[consumer]", *(f"{k} = {v}" for k, v in consumer.items()), "[breaker]"]
    lines += [f"{k} = {v}" for k, v in breaker.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def group(engine: Engine) -> str:
    pgq.create_topic(engine, "orders")
    pgq.subscribe(engine, "billing", "orders")
    return "billing"


def test_a_config_file_sets_every_key_including_workers(engine, group, tmp_path: Path):
    path = tmp_path / "pgq.toml"
    path.write_text(_toml(NOT_DEFAULT))
    consumer = pgq.Consumer(engine, group, lambda m: None, config=path)
    assert consumer.settings.as_dict() == NOT_DEFAULT
    consumer.start()
    try:
        workers = [t for t in threading.enumerate() if t.name.startswith("pgq-worker-")]
        assert len(workers) == 3
    finally:
        consumer.stop(timeout=5)


def test_keywords_override_the_file(engine, group, tmp_path: Path):
    path = tmp_path / "pgq.toml"
    path.write_text(_toml(NOT_DEFAULT))
    consumer = pgq.Consumer(engine, group, lambda m: None, 2, config=path, lease="90s")
    assert consumer.settings.workers == 2
    assert consumer.settings.lease == 90.0
    assert consumer.settings.batch_size == 7


def test_a_settings_object_is_used_as_it_is(engine, group):
    settings = Settings(**{**DEFAULTS, "workers": 5, "lease": 8.0})
    consumer = pgq.Consumer(engine, group, lambda m: None, settings=settings)
    assert consumer.settings is settings


def test_a_settings_object_does_not_mix_with_keywords(engine, group, tmp_path: Path):
    settings = dataclasses.replace(Settings(), workers=5)
    with pytest.raises(pgq.UsageError, match="settings="):
        pgq.Consumer(engine, group, lambda m: None, settings=settings, lease=4)
    with pytest.raises(pgq.UsageError, match="settings="):
        pgq.Consumer(engine, group, lambda m: None, 3, settings=settings)
