"""pgq: a PostgreSQL message queue whose consumer groups share a circuit breaker.

When a downstream dependency dies, the group stops together, probes with real
traffic through one elected prober, and on recovery refunds what the outage
did to its messages. See DESIGN and the README for the whole story.

Everything in `__all__` is the public API; the recipes in conf/ (Dagster, Airflow)
use nothing else. `load_settings` and `load_handler` give a script or an
orchestrator what `pgq consume` does with its config file, `PGQ_*` variables and
`--handler MODULE:FUNCTION`.

Each name is imported on first use (PEP 562), and so is each submodule
(`pgq.store`, `pgq.monitor`): `import pgq` itself loads nothing heavy, so the
`pgq` command can hold its stop signals before SQLAlchemy and psycopg load
(`pgq.cli.startup`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pgq.consumer import Consumer
    from pgq.consumer.handling import load_handler
    from pgq.errors import (
        ConfigError,
        DatabaseUnavailable,
        PartialFailure,
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
    from pgq.store.lifecycle import delete_topic, topics, unsubscribe

__all__ = [
    "ConfigError",
    "Consumer",
    "DatabaseUnavailable",
    "Message",
    "PartialFailure",
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
    "delete_topic",
    "load_handler",
    "load_settings",
    "migrate",
    "publish",
    "publish_many",
    "status",
    "subscribe",
    "topics",
    "unsubscribe",
]

_HOMES = {
    "Consumer": "pgq.consumer",
    "load_handler": "pgq.consumer.handling",
    **dict.fromkeys(
        (
            "ConfigError",
            "DatabaseUnavailable",
            "PartialFailure",
            "PermanentError",
            "PgqError",
            "RetryLater",
            "SystemicError",
            "UnknownGroup",
            "UnknownTopic",
            "UsageError",
        ),
        "pgq.errors",
    ),
    "status": "pgq.monitor",
    "Message": "pgq.records",
    "RunSummary": "pgq.records",
    "Settings": "pgq.settings",
    "load_settings": "pgq.settings",
    **dict.fromkeys(
        ("connect", "create_topic", "migrate", "publish", "publish_many", "subscribe"),
        "pgq.store",
    ),
    # (from their module: `pgq.store.topics` is also a module's name)
    **dict.fromkeys(("delete_topic", "topics", "unsubscribe"), "pgq.store.lifecycle"),
}
"""The module each public name comes from."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
