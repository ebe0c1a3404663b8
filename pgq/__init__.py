"""pgq: a PostgreSQL message queue whose consumer groups share a circuit breaker.

When a downstream dependency dies, the group stops together, probes with real
traffic through one elected prober, and on recovery refunds what the outage
did to its messages. See DESIGN and the README for the whole story.

Everything in `__all__` is the public API; the recipes in conf/ (Dagster, Airflow)
use nothing else. `load_settings` and `load_handler` give a script or an
orchestrator what `pgq consume` does with its config file, `PGQ_*` variables and
`--handler MODULE:FUNCTION`.
"""

from __future__ import annotations

from pgq.consumer import Consumer
from pgq.consumer.handling import load_handler
from pgq.errors import (
    ConfigError,
    DatabaseUnavailable,
    PermanentError,
    PgqError,
    RetryLater,
    SystemicError,
    UnknownGroup,
    UnknownTopic,
    UsageError,
)
from pgq.monitor import status
from pgq.records import Message, RunSummary
from pgq.settings import Settings, load_settings
from pgq.store import connect, create_topic, migrate, publish, publish_many, subscribe

__all__ = [
    "ConfigError",
    "Consumer",
    "DatabaseUnavailable",
    "Message",
    "PermanentError",
    "PgqError",
    "RetryLater",
    "RunSummary",
    "Settings",
    "SystemicError",
    "UnknownGroup",
    "UnknownTopic",
    "UsageError",
    "connect",
    "create_topic",
    "load_handler",
    "load_settings",
    "migrate",
    "publish",
    "publish_many",
    "status",
    "subscribe",
]
