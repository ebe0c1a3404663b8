"""The database boundary: the only package that imports psycopg or `pgq.sql`.

- `engine`: where PostgreSQL comes from (`connect`) and the schema in use;
- `errors`: driver errors become pgq errors, by SQLSTATE class;
- `connections`: the role, lock and LISTEN connections and the retry policy;
- `group`: the consumer's statements for one group (`GroupStore`), by concern in
  `scope`, `claims`, `outcomes`, `breaker`, `housekeeping` and `membership`;
- `topics`: topics, groups and publishing;
- `lifecycle`: listing topics, removing a group or a topic (audited);
- `migrations`: the versioned schema;
- `inspect`: the reads behind status, members, breaker, dead and check;
- `messages`: finding a group's messages by filter, a keyset page at a time;
- `admin`: audited requeue and purge, the reads behind show and audit, and the
  demo's housekeeping.
"""

from __future__ import annotations

from pgq.store.admin import (
    PurgeResult,
    RequeueResult,
    database_now,
    drop_schema,
    purge,
    requeue,
)
from pgq.store.connections import (
    Link,
    Listener,
    LostLock,
    MemberLinks,
    RoleConnection,
    SessionLock,
    member_links,
    member_lock,
    private_link,
    probe_lock,
    probe_lock_key,
    run_hot,
    run_once,
)
from pgq.store.engine import (
    DEFAULT_SCHEMA,
    check_dsn,
    connect,
    conninfo_of,
    first_line,
    has_password,
    resolve_dsn,
    resolve_schema,
    schema_of,
    with_connect_timeout,
)
from pgq.store.errors import translate, wrap_errors
from pgq.store.group import GroupStore
from pgq.store.lifecycle import TopicDeleted, Unsubscribed, delete_topic, topics, unsubscribe
from pgq.store.migrations import LATEST, migrate
from pgq.store.topics import create_topic, group_info, publish, publish_many, subscribe, to_json

__all__ = [
    "DEFAULT_SCHEMA",
    "LATEST",
    "GroupStore",
    "Link",
    "Listener",
    "LostLock",
    "MemberLinks",
    "PurgeResult",
    "RequeueResult",
    "RoleConnection",
    "SessionLock",
    "TopicDeleted",
    "Unsubscribed",
    "check_dsn",
    "connect",
    "conninfo_of",
    "create_topic",
    "database_now",
    "delete_topic",
    "drop_schema",
    "first_line",
    "group_info",
    "has_password",
    "member_links",
    "member_lock",
    "migrate",
    "private_link",
    "probe_lock",
    "probe_lock_key",
    "publish",
    "publish_many",
    "purge",
    "requeue",
    "resolve_dsn",
    "resolve_schema",
    "run_hot",
    "run_once",
    "schema_of",
    "subscribe",
    "to_json",
    "topics",
    "translate",
    "unsubscribe",
    "with_connect_timeout",
    "wrap_errors",
]
