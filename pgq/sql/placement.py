"""Where each table lives on a Citus cluster (`pgq init --distributed`), and the
statements that place it there. Why this placement: `docs/decisions/0023-citus-placement.md`.

- reference tables (a copy on every node): the small catalogues;
- distributed by group, all co-located with `delivery` (a group's rows of every
  table on one shard): what a member reads and writes per message and per second;
- `message` distributed by topic, in a co-location group of its own.

A distributed table's primary key must contain its distribution column, so on Citus
`message` and `audit` get keys that lead with it; on one server nothing changes.
On Citus a trigger gives each delivery row the xid of the worker's transaction that
inserts it (the column's default is evaluated on the coordinator; 0023, section 5).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Table, text
from sqlalchemy.sql import Executable, TextClause

from pgq import schema as t

REFERENCE: tuple[Table, ...] = (t.schema_version, t.topic, t.consumer_group)
"""Copied to every node, in this order (`consumer_group` refers to `topic`)."""

ANCHOR = t.delivery
"""The first table distributed by group: the others are co-located with it."""

BY_GROUP: tuple[Table, ...] = (
    t.delivery,
    t.group_state,
    t.member,
    t.breaker,
    t.breaker_history,
    t.probe,
    t.audit,
    t.attempt,
    t.group_sample,
)
"""Distributed by `group_id`, co-located with `ANCHOR` (first)."""

BY_TOPIC: tuple[Table, ...] = (t.message,)
"""Distributed by `topic_id`, in their own co-location group."""

DISTRIBUTION_COLUMN = {
    **{table.name: "group_id" for table in BY_GROUP},
    **{table.name: "topic_id" for table in BY_TOPIC},
}

PRIMARY_KEY_ON_CITUS = {"message": ("topic_id", "id"), "audit": ("group_id", "id")}
"""The primary keys that change on Citus (the distribution column first)."""


def citus_version() -> Executable:
    """The version of the `citus` extension in this database (no row without it)."""
    return text("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'citus'")


def is_coordinator() -> Executable:
    """True when this node is the coordinator (group 0 in Citus's metadata)."""
    return text("SELECT pg_catalog.citus_is_coordinator()")


def placement_of() -> Executable:
    """How table `:table` (a qualified name) is placed: Citus's partition method,
    replication model and distribution column, or no row for a plain table."""
    return text(
        "SELECT partmethod::text AS method, repmodel::text AS model,"
        " pg_catalog.column_to_column_name(logicalrelid, partkey) AS column"
        " FROM pg_catalog.pg_dist_partition WHERE logicalrelid = CAST(:table AS regclass)"
    )


def create_reference_table() -> Executable:
    """Make `:table` a reference table."""
    return text("SELECT pg_catalog.create_reference_table(CAST(:table AS regclass))")


def create_distributed_table() -> Executable:
    """Distribute `:table` by `:column`, co-located with `:colocate_with` (a qualified
    table name, or 'none' for a co-location group of its own)."""
    return text(
        "SELECT pg_catalog.create_distributed_table(CAST(:table AS regclass), :column,"
        " colocate_with => :colocate_with)"
    )


def primary_key_with(qualified: str, table: Table, columns: tuple[str, ...]) -> TextClause:
    """Replace `table`'s primary key by one on `columns` (`qualified` is its quoted,
    schema-qualified name; the key keeps its name)."""
    key = table.primary_key.name or f"{table.name}_pkey"
    cols = ", ".join(f'"{c}"' for c in columns)
    return text(
        f'ALTER TABLE {qualified} DROP CONSTRAINT "{key}",'
        f' ADD CONSTRAINT "{key}" PRIMARY KEY ({cols})'
    )


def sequential() -> Executable:
    """Send this transaction's commands to each node over one connection: a function
    (the xid trigger's) can be created in a transaction only if no command of it ran
    over several connections to a node before."""
    return text("SELECT set_config('citus.multi_shard_modify_mode', 'sequential', true)")


XID_TRIGGER = "delivery_local_xid"
"""The trigger (and its function) that sets `delivery.xid` on the shard."""


def create_xid_function(schema: str) -> TextClause:
    """The trigger function `XID_TRIGGER` in `schema` (quoted): the row's xid is the
    transaction's on the node that inserts it. It sets a column of the row it is
    given and reads or writes nothing else (what makes a trigger on shards safe)."""
    return text(
        f"CREATE OR REPLACE FUNCTION {schema}.{XID_TRIGGER}() RETURNS trigger"
        " LANGUAGE plpgsql AS $$BEGIN NEW.xid := pg_current_xact_id(); RETURN NEW; END$$"
    )


def has_xid_trigger() -> Executable:
    """True when table `:table` (a qualified name) has the xid trigger."""
    return text(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger"
        " WHERE tgrelid = CAST(:table AS regclass) AND tgname = :trigger)"
    ).bindparams(trigger=XID_TRIGGER)


def allow_triggers() -> Executable:
    """Let this transaction create a trigger on a distributed table (Citus refuses
    otherwise: `triggers are not supported on distributed tables`)."""
    return text("SELECT set_config('citus.enable_unsafe_triggers', 'on', true)")


def create_xid_trigger(schema: str, delivery: str) -> TextClause:
    """Fire `XID_TRIGGER` before each insert into `delivery` (quoted, qualified): on
    every shard, on the worker that holds it."""
    return text(
        f"CREATE TRIGGER {XID_TRIGGER} BEFORE INSERT ON {delivery}"
        f" FOR EACH ROW EXECUTE FUNCTION {schema}.{XID_TRIGGER}()"
    )


def shard_nodes() -> Executable:
    """The node (`nodename`, `nodeport`) holding the shard of `:table` (a qualified
    name) for each distribution value of `:values`."""
    return text(
        "SELECT v.value, s.nodename, s.nodeport"
        " FROM unnest(CAST(:values AS integer[])) AS v(value)"
        " JOIN pg_catalog.citus_shards s ON s.shardid ="
        " pg_catalog.get_shard_id_for_distribution_column(CAST(:table AS regclass), v.value)"
    )


def on_workers() -> Executable:
    """`:command` (one value) run on every worker: nodename, nodeport, success, result."""
    return text(
        "SELECT nodename, nodeport, success, result"
        " FROM pg_catalog.run_command_on_workers(CAST(:command AS text))"
    )


def backend_gpid() -> Executable:
    """This backend's global process id (its backends on the workers carry it in
    their `application_name`, `citus_internal gpid=…`)."""
    return text("SELECT pg_catalog.citus_backend_gpid()")


def pending_commits(before: dt.datetime) -> str:
    """A command for `on_workers`: how many transactions of this database were
    prepared on the worker before `before` and are not yet committed or rolled back
    (a distributed transaction's part between its `PREPARE` and `COMMIT PREPARED`,
    or left in doubt until Citus recovers it). `before` is a timestamp pgq took
    from the database, written in as an ISO literal."""
    return (
        "SELECT count(*) FROM pg_catalog.pg_prepared_xacts"
        " WHERE database = current_database()"
        f" AND prepared < '{before.isoformat()}'::timestamptz"
    )


def cutoff() -> Executable:
    """Now plus a second, by the coordinator's clock: prepared transactions before it
    may be parts of what a read just saw committed elsewhere (the second covers
    the nodes' clocks disagreeing a little)."""
    return text("SELECT clock_timestamp() + interval '1 second'")


def recover_prepared() -> Executable:
    """Commit or roll back the prepared transactions whose outcome the coordinator
    knows (Citus's own recovery, which otherwise runs every
    `citus.recover_2pc_interval`)."""
    return text("SELECT pg_catalog.recover_prepared_transactions()")


MULTI_TASK_LEVEL = "citus.multi_task_query_log_level"
"""The Citus setting that logs (or, at `error`, refuses) a statement of several tasks."""


def allow_multi_task() -> Executable:
    """Let this transaction's next statements run on several shards: the setting
    `MULTI_TASK_LEVEL` off until `restore_multi_task` (or the transaction's end);
    returns what it was."""
    return text(
        f"SELECT current_setting('{MULTI_TASK_LEVEL}') AS before,"
        f" set_config('{MULTI_TASK_LEVEL}', 'off', true) AS now"
    )


def restore_multi_task() -> Executable:
    """Set `MULTI_TASK_LEVEL` back to `:before` for the rest of this transaction."""
    return text(f"SELECT set_config('{MULTI_TASK_LEVEL}', :before, true)")
