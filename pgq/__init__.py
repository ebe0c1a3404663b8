"""pgq: a PostgreSQL message queue whose consumer groups share a circuit breaker.

When a downstream dependency dies, the group stops together, probes with real
traffic through one elected prober, and on recovery refunds what the outage
did to its messages. See DESIGN and the README for the whole story.
"""

from __future__ import annotations

from pgq.consumer import Consumer
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
from pgq.settings import Settings
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
    "migrate",
    "publish",
    "publish_many",
    "status",
    "subscribe",
]
