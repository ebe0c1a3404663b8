"""Versioned schema migrations: `pgq init` / `pgq.migrate(engine)`.

Safe when several processes run it at once: each migration run holds a
transaction-level advisory lock derived from the schema name, so the second
runner waits and then finds nothing to do. Each migration is applied in the
same transaction as its row in `schema_version`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, Table, func, insert, select
from sqlalchemy.schema import CreateSchema

from pgq import schema as t
from pgq.errors import PgqError, UsageError
from pgq.sql import frontier as frontier_sql
from pgq.sql import placement as place
from pgq.sql import privileges as privileges_sql
from pgq.sql import upgrade
from pgq.sql.locks import lock_key, xact_lock
from pgq.store import placement
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors
from pgq.store.privileges import carry_grants, carry_restrictions

logger = logging.getLogger(__name__)


def _v1_initial(conn: Connection) -> None:
    # A fresh install: the tables as declared in pgq.schema now. A database
    # that holds an older version as released (tests/fixtures/schemas/v<N>.sql)
    # gets the objects added since from the migrations below, which check what
    # exists first, so every path ends in the same schema
    # (tests/integration/test_upgrade.py).
    t.metadata.create_all(conn, checkfirst=False)


def _v2_charged_index(conn: Connection) -> None:
    # Reconciliation finds the rows an outage charged whatever their error class
    # (a row that died of reclaims too): index them by the epoch of their charge.
    # A fresh install already has it from version 1 (the tables as declared).
    t.charged_index.create(conn, checkfirst=True)


def _v3_probe_log(conn: Connection) -> None:
    # Every group probe with its outcome, for the breaker's timeline. A fresh
    # install already has it from version 1 (the tables as declared). Roles
    # granted a job before keep being able to do it (decision 0022).
    t.probe.create(conn, checkfirst=True)
    _granted(conn, carry_grants(conn, t.probe.name, privileges_sql.PROBE_LOG_CARRIED))


def _v4_group_state(conn: Connection) -> None:
    # The frontier and the running totals move out of `consumer_group` into
    # `group_state` (on Citus on the group's shard; decision 0023, section 4), and
    # a delivery row's xid comes from the transaction that inserts it, not from
    # its message. A fresh install has both from version 1 (the tables as declared).
    t.group_state.create(conn, checkfirst=True)
    schema = schema_of(conn)
    params = {"schema": schema, "table": t.consumer_group.name}
    columns = set(conn.execute(upgrade.columns_of(), params).scalars())
    moved = list(upgrade.MOVED_TO_GROUP_STATE)
    if set(moved) <= columns:
        conn.execute(upgrade.copy_group_state(moved))
        conn.execute(upgrade.drop_columns(_qualified(conn, t.consumer_group), moved))
    conn.execute(upgrade.delivery_xid_default(_qualified(conn, t.delivery)))
    _granted(conn, carry_grants(conn, t.group_state.name, privileges_sql.GROUP_STATE_CARRIED))


def _v5_audit_names(conn: Connection) -> None:
    # The audit row records the database role that wrote it, and the names of its
    # group and topic, so `pgq audit` still shows the trail of a group removed by
    # `pgq unsubscribe` (decision 0033). Rows written before keep a NULL role (the
    # column gets its default after it is added, so they are not credited to the
    # role that migrates); their names are filled in from the groups that exist.
    # A fresh install already has the columns from version 1 (the tables as declared).
    # Administrators granted before may remove groups and topics (`pgq unsubscribe`,
    # `pgq topic delete`) as well.
    for name, carried in privileges_sql.REMOVALS_CARRIED.items():
        _granted(conn, carry_grants(conn, name, carried))
    params = {"schema": schema_of(conn), "table": t.audit.name}
    columns = set(conn.execute(upgrade.columns_of(), params).scalars())
    added = [c for c in ("role", "group_name", "topic") if c not in columns]
    if not added:
        return
    audit = _qualified(conn, t.audit)
    conn.execute(upgrade.add_text_columns(audit, added))
    if "role" in added:
        conn.execute(upgrade.role_default(audit))
    conn.execute(upgrade.name_audit_rows())


def _v6_group_start(conn: Connection) -> None:
    # The ack deletes the rows it finishes (decision 0037): `pgq show` tells a
    # finished message from one the group never had by where the group started.
    # Groups subscribed before keep NULL (not known). A fresh install already has
    # the column from version 1 (the tables as declared).
    params = {"schema": schema_of(conn), "table": t.consumer_group.name}
    if "start" not in set(conn.execute(upgrade.columns_of(), params).scalars()):
        conn.execute(upgrade.add_group_start(_qualified(conn, t.consumer_group)))


def _v7_dedupe_key(conn: Connection) -> None:
    # Idempotent publish (decision 0040): a nullable key on the message and a partial
    # unique index of (topic, key). The index is built here, in the migration's
    # transaction: the column's lock, held to its commit, holds what reads or writes
    # `message` (publishing, the claim's read of bodies, retention) for one scan of
    # the table, with nothing to sort (every key is NULL). An operator
    # who cannot hold publishing that long builds it beforehand, CONCURRENTLY, under
    # the same name (docs/operations.md); one as declared is kept, any other (a
    # concurrent build that failed, one built otherwise by hand) is built again. A
    # fresh install already has both from version 1 (the tables as declared). A role
    # granted a producer's privileges before gets what publishing with keys needs.
    params = {"schema": schema_of(conn), "table": t.message.name}
    if "dedupe_key" not in set(conn.execute(upgrade.columns_of(), params).scalars()):
        conn.execute(upgrade.add_dedupe_key(_qualified(conn, t.message)))
    for name, carried in privileges_sql.DEDUPE_CARRIED.items():
        _granted(conn, carry_grants(conn, name, carried))
    index = _qualified_name(conn, str(t.dedupe_index.name))
    declared = {
        "index": index,
        "columns": [column.name for column in t.dedupe_index.columns],
        "predicate": "(dedupe_key IS NOT NULL)",
    }
    kept = conn.execute(upgrade.index_as_declared(), declared).scalar()
    if kept is True:
        return
    if kept is False:  # a failed concurrent build, or one built otherwise by hand
        logger.warning(
            "migration rebuilds an index not as declared (invalid, not unique, other"
            " columns or predicate) schema=%s index=%s",
            schema_of(conn),
            index,
        )
        conn.execute(upgrade.drop_index(index))
    t.dedupe_index.create(conn)


def _v8_ordered_groups(conn: Connection) -> None:
    # Ordered groups (decision 0044): a flag on the group and, on the delivery rows of
    # ordered groups only, the message's key, with two partial indexes of keyed rows.
    # Every row that exists has no key, so each index is built by one scan of
    # `delivery` (its live rows: finished rows are deleted) and holds nothing. A fresh
    # install already has all of it from version 1 (the tables as declared).
    schema = schema_of(conn)
    groups = {"schema": schema, "table": t.consumer_group.name}
    if "ordered" not in set(conn.execute(upgrade.columns_of(), groups).scalars()):
        conn.execute(upgrade.add_group_ordered(_qualified(conn, t.consumer_group)))
    rows = {"schema": schema, "table": t.delivery.name}
    if "key" not in set(conn.execute(upgrade.columns_of(), rows).scalars()):
        conn.execute(upgrade.add_text_columns(_qualified(conn, t.delivery), ["key"]))
    for index in (t.key_order_index, t.key_leased_index):
        index.create(conn, checkfirst=True)


def _v9_history_and_samples(conn: Connection) -> None:
    # Two tables of a group's rows, each restricted as the others where roles are
    # restricted to some groups (decision 0034), so a restricted role sees only its
    # groups' lines and samples. A fresh install already has both from version 1 (the
    # tables as declared).
    _attempt_history(conn)
    _group_samples(conn)


def _v10_xid_space(conn: Connection) -> None:
    # Each group's frontier names the xid space it counts in (decision 0047), so that
    # a group whose rows moved to another server (a Citus shard move, a restore)
    # starts its frontier again there instead of stalling or passing new rows.
    # Existing groups get the space of the server that holds them now (else each
    # group's next advance would start its frontier again), one routed statement per
    # group: on Citus each group's node's. (A schema from before version 4 got the
    # column with its `group_state` table.)
    rows = {"schema": schema_of(conn), "table": t.group_state.name}
    qualified = _qualified(conn, t.group_state)
    if "xid_space" not in set(conn.execute(upgrade.columns_of(), rows).scalars()):
        conn.execute(upgrade.add_group_xid_space(qualified))
    for gid in conn.scalars(select(t.consumer_group.c.id)).all():
        conn.execute(frontier_sql.name_xid_space(), {"gid": gid})


def _attempt_history(conn: Connection) -> None:
    # Every message's recent history in a group (decision 0046): the `attempt` table
    # and, on each delivery row, the count of lines it has written. Rows that exist
    # start with none (their earlier attempts were not recorded). Roles granted a
    # consumer's or a reader's privileges on the probe log before get theirs on the
    # history.
    rows = {"schema": schema_of(conn), "table": t.delivery.name}
    if "events" not in set(conn.execute(upgrade.columns_of(), rows).scalars()):
        conn.execute(upgrade.add_delivery_events(_qualified(conn, t.delivery)))
    created = not _exists(conn, t.attempt)
    t.attempt.create(conn, checkfirst=True)
    _granted(conn, carry_grants(conn, t.attempt.name, privileges_sql.HISTORY_CARRIED))
    if created:
        _granted(conn, carry_restrictions(conn, t.attempt.name))


def _group_samples(conn: Connection) -> None:
    # The charts' samples (decision 0045): one row per group per minute, written by
    # members and the dashboard. Roles granted a job before keep being able to do it.
    created = not _exists(conn, t.group_sample)
    t.group_sample.create(conn, checkfirst=True)
    _granted(conn, carry_grants(conn, t.group_sample.name, privileges_sql.SAMPLES_CARRIED))
    if created:
        _granted(conn, carry_restrictions(conn, t.group_sample.name))


def _exists(conn: Connection, table: Table) -> bool:
    return conn.scalar(select(func.to_regclass(_qualified(conn, table)))) is not None


def _granted(conn: Connection, statements: list[str]) -> None:
    for statement in statements:
        logger.info("migration granted schema=%s statement=%s", schema_of(conn), statement)


def _qualified(conn: Connection, table: Table) -> str:
    """`table`'s schema-qualified name in `conn`'s schema, quoted."""
    return _qualified_name(conn, table.name)


def _qualified_name(conn: Connection, name: str) -> str:
    """Relation `name`'s schema-qualified name in `conn`'s schema, quoted."""
    prep = conn.dialect.identifier_preparer
    return f"{prep.quote_schema(schema_of(conn))}.{prep.quote(name)}"


MIGRATIONS: tuple[tuple[int, str, Callable[[Connection], None]], ...] = (
    (1, "initial tables", _v1_initial),
    (2, "index of the rows an outage charged", _v2_charged_index),
    (3, "the probe log", _v3_probe_log),
    (4, "group state apart from the group, delivery xid from its insert", _v4_group_state),
    (5, "audit rows name their role, group and topic", _v5_audit_names),
    (6, "a group records where it started", _v6_group_start),
    (7, "messages carry a dedupe key, unique per topic", _v7_dedupe_key),
    (8, "ordered groups: the group's flag, its rows' keys", _v8_ordered_groups),
    (9, "every message's recent history; the charts' samples", _v9_history_and_samples),
    (10, "a group's frontier names its xid space", _v10_xid_space),
)
LATEST = MIGRATIONS[-1][0]


def current_version(conn: Connection) -> int:
    """The schema version installed (0 when the schema is not installed)."""
    exists = conn.scalar(select(func.to_regclass(f"{schema_of(conn)}.schema_version")))
    if exists is None:
        return 0
    return int(conn.scalar(select(func.coalesce(func.max(t.schema_version.c.version), 0))) or 0)


def migrate(engine: Engine, *, distributed: bool = False) -> int:
    """Create or upgrade pgq's schema; idempotent and concurrent-safe.

    With `distributed`, on a Citus coordinator, the tables are then placed on the
    cluster as `pgq.sql.placement` says (tables already placed are left alone); on
    any other server that is an error and nothing is written. Without it the
    schema is the same on every server, except that a schema placed before is
    upgraded in place: the tables a migration adds are placed too.

    Returns the schema version now installed.
    """
    schema = schema_of(engine)
    with wrap_errors(), engine.begin() as conn:
        conn.execute(xact_lock(lock_key(schema, "migrate")))
        if distributed:
            _require_coordinator(conn)
        # a schema placed before is upgraded in place: new tables placed as well
        distributed = distributed or placement.distributed(conn)
        if distributed:
            conn.execute(place.sequential())
        conn.execute(CreateSchema(schema, if_not_exists=True))
        version = _upgrade(conn, schema)
        if distributed:
            _distribute(conn, schema)
    placement.forget(engine)  # placed now: ask again
    return version


def _upgrade(conn: Connection, schema: str) -> int:
    """Apply the migrations the schema lacks; returns the version now installed."""
    version = current_version(conn)
    if version > LATEST:
        raise PgqError(
            f"schema {schema} is at version {version}, newer than this pgq knows ({LATEST})"
        )
    for number, description, apply in MIGRATIONS:
        if number <= version:
            continue
        with placement.spanning(conn, placement.Spanning.UPGRADE):  # every group's rows
            apply(conn)
        conn.execute(insert(t.schema_version).values(version=number))
        logger.info("migration applied schema=%s version=%d what=%s", schema, number, description)
        version = number
    return version


def _require_coordinator(conn: Connection) -> None:
    """`UsageError` unless this database is a Citus coordinator."""
    if conn.scalar(place.citus_version()) is None:
        raise UsageError(
            "--distributed needs a Citus coordinator: the citus extension is not"
            " installed in this database"
        )
    if not conn.scalar(place.is_coordinator()):
        raise UsageError("--distributed needs a Citus coordinator: this node is a worker")


def _distribute(conn: Connection, schema: str) -> None:
    """Place every table on the cluster (`pgq.sql.placement`); idempotent."""
    prep = conn.dialect.identifier_preparer

    def name(table: Table) -> str:
        return f"{prep.quote_schema(schema)}.{prep.quote(table.name)}"

    def placed(table: Table) -> Any:
        return conn.execute(place.placement_of(), {"table": name(table)}).first()

    for table in place.REFERENCE:
        row = placed(table)
        if row is None or row.model != "t":  # plain, or a Citus local table
            conn.execute(place.create_reference_table(), {"table": name(table)})
    # by group first: `delivery` starts the default co-location group, and `message`
    # (colocate_with 'none') then gets one of its own
    colocated = ((name(place.ANCHOR), place.BY_GROUP), ("none", place.BY_TOPIC))
    for colocate_with, tables in colocated:
        for table in tables:
            row = placed(table)
            if row is not None and row.method == "h":
                continue
            # a Citus local table (one that refers to a reference table, such as
            # `breaker`, becomes one when its reference is placed) is distributed as is
            key = place.PRIMARY_KEY_ON_CITUS.get(table.name)
            if key is not None:
                conn.execute(place.primary_key_with(name(table), table, key))
            conn.execute(
                place.create_distributed_table(),
                {
                    "table": name(table),
                    "column": place.DISTRIBUTION_COLUMN[table.name],
                    # the anchor itself starts the group's co-location group
                    "colocate_with": "default" if table is place.ANCHOR else colocate_with,
                },
            )
    if not conn.execute(place.has_xid_trigger(), {"table": name(t.delivery)}).scalar():
        conn.execute(place.create_xid_function(prep.quote_schema(schema)))
        conn.execute(place.allow_triggers())
        conn.execute(place.create_xid_trigger(prep.quote_schema(schema), name(t.delivery)))
    logger.info("tables distributed schema=%s", schema)
