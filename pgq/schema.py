"""pgq's tables, defined once as SQLAlchemy Core `Table`s.

Every table lives in the schema named `pgq` here; the schema that is actually
used is chosen at run time through SQLAlchemy's `schema_translate_map` (see
`pgq.connect`), so one set of `Table` objects serves every schema and the
statement cache keeps working.

Why the indexes are what they are: `docs/decisions/0002-delivery-indexes.md`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    SmallInteger,
    Table,
    Text,
    and_,
    func,
    literal_column,
    or_,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP
from sqlalchemy.types import UserDefinedType

from pgq.records import (
    AttemptEvent,
    BreakerState,
    ErrorClass,
    LocalBreakerState,
    RowState,
    Start,
)

SCHEMA_PLACEHOLDER = "pgq"
"""The schema name the tables are declared in; translated at run time."""

metadata = MetaData(schema=SCHEMA_PLACEHOLDER)


class XID8(UserDefinedType[str]):
    """PostgreSQL's 64-bit transaction id type (`xid8`, PostgreSQL 13+)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "xid8"


XID_SPACE = "(pg_catalog.pg_control_system()).system_identifier"
"""The xid space of the server that evaluates it: its system identifier, fixed at
`initdb` (a physical standby shares its primary's, and its xids). Written as an
expression, not a subquery, so that Citus ships it to the worker that holds a
group's shard inside a routed SELECT (decision 0047); Citus evaluates it on the
coordinator in an INSERT's values or an UPDATE's SET, so it is never written there."""


def _tstz() -> TIMESTAMP:
    return TIMESTAMP(timezone=True)


def _now_column(name: str) -> Column[Any]:
    return Column(name, _tstz(), nullable=False, server_default=func.now())


def _word(word: str) -> str:
    """`word` as an SQL string literal: `'ready'`."""
    return f"'{word}'"


def _one_of(column: str, *words: str) -> str:
    """A CHECK expression: `column IN ('a', 'b')`, the words in the order given."""
    return f"{column} IN ({', '.join(_word(w) for w in words)})"


def _counter(name: str) -> Column[Any]:
    return Column(name, BigInteger, nullable=False, server_default=text("0"))


schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    _now_column("applied_at"),
)

topic = Table(
    "topic",
    metadata,
    Column("id", Integer, Identity(), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    _now_column("created_at"),
)

message = Table(
    "message",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    # no foreign key: checked by the API, and a trigger per row would cost publish speed
    Column("topic_id", Integer, nullable=False),
    Column("key", Text),
    Column("payload", JSONB(none_as_null=True), nullable=False),
    Column("headers", JSONB(none_as_null=True)),
    _now_column("created_at"),
    # the publishing transaction (`pgq show` places a message without a row against
    # the frontier by it; the frontier itself reads `delivery.xid`)
    Column("xid", XID8(), nullable=False, server_default=text("pg_current_xact_id()")),
    # idempotent publish (schema version 7): while a message of the topic with this
    # key is retained, publishing the key again inserts nothing (decision 0040)
    Column("dedupe_key", Text),
    postgresql_with={"autovacuum_vacuum_scale_factor": "0.02"},
)
Index("message_topic_id_idx", message.c.topic_id, message.c.id)
# idempotent publish: one retained message per (topic, dedupe key); the topic first,
# so that on Citus (`message` distributed by topic) the index is valid and a lookup
# is routed to one shard. Partial: a message without a key costs no index entry.
dedupe_index = Index(
    "message_dedupe_key_idx",
    message.c.topic_id,
    message.c.dedupe_key,
    unique=True,
    postgresql_where=message.c.dedupe_key.is_not(None),
)

consumer_group = Table(
    "consumer_group",
    metadata,
    Column("id", Integer, Identity(), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("topic_id", Integer, ForeignKey("pgq.topic.id"), nullable=False),
    _now_column("created_at"),
    # where its delivery started (schema version 6; NULL for groups subscribed
    # before): `pgq show` tells a finished message whose row the ack deleted by it
    Column("start", Text),
    # messages with the same key are handled one at a time, in frontier order
    # (schema version 8; DESIGN §7 "Ordered groups", decision 0044)
    Column("ordered", Boolean, nullable=False, server_default=text("false")),
    CheckConstraint(_one_of("start", *Start), name="consumer_group_start_check"),
)
"""What a group is: nothing here changes after subscribe (on Citus a reference table,
copied to every node; decision 0023)."""

group_state = Table(
    "group_state",
    metadata,
    Column("group_id", Integer, ForeignKey("pgq.consumer_group.id"), primary_key=True),
    # the contiguity frontier: every delivery row at or below (xid, id) is resolved
    Column("committed_xid", XID8(), nullable=False, server_default=text("'0'::xid8")),
    Column("committed_id", BigInteger),
    # the xid space the frontier counts in: the system identifier of the server that
    # holds the group's rows, named at subscribe (schema version 10).
    # Another value than the server's own means the rows came from elsewhere (a Citus
    # shard move, a restore): the frontier starts again in its xids (decision 0047)
    Column("xid_space", BigInteger),
    # finished rows gone from `delivery`: deleted by the ack that finished them, or
    # (the one row an ack keeps per batch, and rows of earlier versions' members)
    # pruned behind the frontier (decision 0037)
    _counter("done_pruned"),
    _counter("reclaimed_total"),
    _counter("released_total"),
    _counter("refunded_total"),
)
"""What changes as a group runs: its frontier and running totals (schema version 4).
On Citus on the group's shard, beside its delivery rows, so that the statements
writing it are routed there (decision 0023, section 4)."""

lease_token = Sequence("lease_token", metadata=metadata, cache=100)
"""Where lease tokens come from (decision 0004): a member draws a value v once and
gives its claims the tokens -(v * 2^20 + k), k = 0, 1, … (a new v after 2^20
claims). Members of earlier versions drew a positive value per row in the claim
(`nextval`), and may still run during an upgrade: the two never meet."""

delivery = Table(
    "delivery",
    metadata,
    Column("group_id", Integer, nullable=False),
    Column("message_id", BigInteger, nullable=False),
    # the inserting transaction, on the node that holds the row: the frontier
    # advances in (xid, id) order (on Citus a trigger sets it on the shard: the
    # default is evaluated on the coordinator; schema version 4)
    Column("xid", XID8(), nullable=False, server_default=text("pg_current_xact_id()")),
    Column("state", Text, nullable=False, server_default=text(_word(RowState.READY))),
    Column("available_at", _tstz(), nullable=False, server_default=func.now()),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("reclaims", Integer, nullable=False, server_default=text("0")),
    Column("refundable_attempts", Integer, nullable=False, server_default=text("0")),
    Column("refundable_reclaims", Integer, nullable=False, server_default=text("0")),
    Column("refunds", Integer, nullable=False, server_default=text("0")),
    Column("lease_owner", Text),
    # the token of the row's last claim (0: never claimed); outcomes are fenced on
    # (message_id, lease_seq)
    Column("lease_seq", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_expires_at", _tstz()),
    Column("error_class", Text),
    Column("last_error", Text),
    # the breaker epoch the last failure happened under (reconciliation scope)
    Column("error_epoch", Integer),
    _now_column("updated_at"),
    # the message's key, in an ordered group only (NULL elsewhere, so no other
    # group's row is in the key indexes; schema version 8)
    Column("key", Text),
    # lines written to the row's history (`attempt`) so far: the next one is line
    # `events + 1`, in slot `(events + 1) % HISTORY_SLOTS` (schema version 9)
    Column("events", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("group_id", "message_id"),
    CheckConstraint(_one_of("state", *RowState), name="delivery_state_check"),
    CheckConstraint(
        "error_class IS NULL OR " + _one_of("error_class", *ErrorClass),
        name="delivery_error_class_check",
    ),
    # room on each page, so lease extensions (no indexed column) can be HOT updates;
    # and vacuum/analyze early: every message leaves ~3 dead versions here, and
    # the live set is small (rows are pruned behind the frontier)
    postgresql_with={
        "fillfactor": "80",
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_vacuum_insert_scale_factor": "0.01",
        "autovacuum_analyze_scale_factor": "0.01",
        "autovacuum_vacuum_cost_delay": "0",
    },
)
# claim path: ready rows of one group, earliest available first
Index(
    "delivery_ready_idx",
    delivery.c.group_id,
    delivery.c.available_at,
    delivery.c.message_id,
    postgresql_where=delivery.c.state == RowState.READY.value,
)
# lease sweep: leased rows of one group by expiry
Index(
    "delivery_leased_idx",
    delivery.c.group_id,
    delivery.c.lease_expires_at,
    postgresql_where=delivery.c.state == RowState.LEASED.value,
)
# frontier: rows of one group in commit order
Index("delivery_frontier_idx", delivery.c.group_id, delivery.c.xid, delivery.c.message_id)
# ordered groups (schema version 8): a key's unresolved rows, and its rows an outage
# charged, in frontier order; and its leased row. A row without a key (every row of
# an unordered group) is in neither. The predicate's charge test is written as
# `pgq.sql.refunds.carries_charges()` writes it.
key_order_index = Index(
    "delivery_key_order_idx",
    delivery.c.group_id,
    delivery.c.key,
    delivery.c.xid,
    delivery.c.message_id,
    postgresql_where=and_(
        delivery.c.key.is_not(None),
        or_(
            delivery.c.state.in_([RowState.READY.value, RowState.LEASED.value]),
            delivery.c.refundable_attempts + delivery.c.refundable_reclaims > literal_column("0"),
        ),
    ),
)
key_leased_index = Index(
    "delivery_key_leased_idx",
    delivery.c.group_id,
    delivery.c.key,
    postgresql_where=and_(delivery.c.key.is_not(None), delivery.c.state == RowState.LEASED.value),
)
# `pgq dead` and `pgq check`: failed rows only
Index(
    "delivery_failed_idx",
    delivery.c.group_id,
    delivery.c.error_class,
    postgresql_where=delivery.c.error_class.is_not(None),
)
# reconciliation: the rows an outage charged, by the epoch of their last charge
# (schema version 2; the predicate is `pgq.sql.refunds.carries_charges()`)
charged_index = Index(
    "delivery_charged_idx",
    delivery.c.group_id,
    delivery.c.error_epoch,
    postgresql_where=delivery.c.refundable_attempts + delivery.c.refundable_reclaims
    > literal_column("0"),
)

member = Table(
    "member",
    metadata,
    Column("group_id", Integer, nullable=False),
    Column("name", Text, nullable=False),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    _now_column("started_at"),
    _now_column("last_seen"),
    Column(
        "local_breaker", Text, nullable=False, server_default=text(_word(LocalBreakerState.CLOSED))
    ),
    # the group epoch under which the local breaker last tripped
    Column("tripped_epoch", Integer),
    Column("left_at", _tstz()),
    PrimaryKeyConstraint("group_id", "name"),
    CheckConstraint(
        _one_of("local_breaker", *LocalBreakerState), name="member_local_breaker_check"
    ),
)

breaker = Table(
    "breaker",
    metadata,
    Column("group_id", Integer, ForeignKey("pgq.consumer_group.id"), primary_key=True),
    Column("state", Text, nullable=False, server_default=text(_word(BreakerState.CLOSED))),
    _now_column("since"),
    Column("epoch", Integer, nullable=False, server_default=text("0")),
    Column("next_probe_at", _tstz()),
    Column("probe_failures", Integer, nullable=False, server_default=text("0")),
    Column("prober", Text),
    # reconciliation still owed for this close epoch (crash-safe resume)
    Column("reconcile_epoch", Integer),
    Column("reconcile_from_epoch", Integer),
    CheckConstraint(_one_of("state", *BreakerState), name="breaker_state_check"),
)

breaker_history = Table(
    "breaker_history",
    metadata,
    Column("group_id", Integer, nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("state", Text, nullable=False),
    _now_column("at"),
    Column("refunded", BigInteger, nullable=False, server_default=text("0")),
    Column("by_member", Text),
    PrimaryKeyConstraint("group_id", "epoch"),
)

# every group probe with its outcome, written in the statement that records the
# outcome on the breaker row (schema version 3; docs/decisions/0022-probe-log.md)
probe = Table(
    "probe",
    metadata,
    Column("group_id", Integer, nullable=False),
    Column("id", BigInteger, Identity(), nullable=False),
    # the OPEN epoch the probe ran under
    Column("epoch", Integer, nullable=False),
    _now_column("at"),
    Column("member", Text),
    # no foreign key: the log outlives the messages it names until retention
    Column("message_id", BigInteger),
    Column("outcome", Text, nullable=False),
    Column("error_class", Text),
    PrimaryKeyConstraint("group_id", "id"),
    CheckConstraint(
        "outcome IN ('failed', 'inconclusive', 'succeeded')", name="probe_outcome_check"
    ),
    CheckConstraint(
        "error_class IS NULL OR "
        + _one_of("error_class", ErrorClass.SYSTEMIC, ErrorClass.MESSAGE, ErrorClass.PERMANENT),
        name="probe_error_class_check",
    ),
)
# the newest probes of a group, and retention's oldest ones
Index("probe_at_idx", probe.c.group_id, probe.c.at)

HISTORY_SLOTS = 32
"""Lines of history kept per message and group: the newest, in a ring of slots
(line n in slot n % HISTORY_SLOTS), so a message that fails for ever keeps a bounded
history and writing a line never deletes one."""

attempt = Table(
    "attempt",
    metadata,
    Column("group_id", Integer, nullable=False),
    Column("message_id", BigInteger, nullable=False),
    Column("slot", SmallInteger, nullable=False),
    # the line's number in the message's history in this group (1, 2, ...)
    Column("n", Integer, nullable=False),
    _now_column("at"),
    Column("event", Text, nullable=False),
    # the member that ran the attempt (or held the lease that expired)
    Column("member", Text),
    # how long the handler ran (a failure), when the member measured it
    Column("seconds", Float),
    Column("error_class", Text),
    Column("error", Text),
    # the group breaker's epoch: the attempt ran under it, the reclaim or the refund
    # was charged or made under it
    Column("epoch", Integer),
    # the row's counters after the line: attempts, reclaims, refunds
    Column("attempts", Integer, nullable=False),
    Column("reclaims", Integer, nullable=False),
    Column("refunds", Integer, nullable=False),
    PrimaryKeyConstraint("group_id", "message_id", "slot"),
    CheckConstraint(_one_of("event", *AttemptEvent), name="attempt_event_check"),
)
"""Every message's recent history in a group: its failed attempts, snoozes,
expired leases and refunds, written by the statements that make them (schema
version 9; decision 0046). A success writes nothing here. Lines outlive their
delivery row (the ack deletes it, a purge too): retention deletes them by age, as
it does the messages, and `unsubscribe` with the group."""
# retention's oldest lines of a group
Index("attempt_at_idx", attempt.c.group_id, attempt.c.at)

group_sample = Table(
    "group_sample",
    metadata,
    Column("group_id", Integer, nullable=False),
    # the start of the minute the sample is of (the database clock): one row per
    # group per minute, the first writer's (schema version 9; decision 0045)
    Column("at", _tstz(), nullable=False),
    # finished rows so far as `group_state.done_pruned` counts them (the ack deletes
    # what it finishes but one row per batch, which the frontier prunes within a
    # second): throughput is its growth between samples
    Column("done", BigInteger, nullable=False),
    Column("lag", BigInteger, nullable=False),  # ready + leased, as `pgq status`
    Column("dead", BigInteger, nullable=False),
    # seconds the oldest row claimable then had been claimable (NULL: none was)
    Column("oldest_ready_age_s", Float),
    PrimaryKeyConstraint("group_id", "at"),
)
"""Each group's numbers once a minute, for the dashboard's charts: written by the
group's members (the first of a minute wins) and by the dashboard, kept a day
(`pgq.sql.samples`)."""
# the overview: every group's last hour (30,000 rows of 720,000 with 500 groups: a
# sequential scan of the day took 170 ms); a group's own reads use the primary key
Index("group_sample_at_idx", group_sample.c.at)

audit = Table(
    "audit",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    _now_column("at"),
    # `NO_GROUP` (0) in a row about a topic (`delete-topic`): no group has id 0
    Column("group_id", Integer, nullable=False),
    Column("action", Text, nullable=False),
    Column("message_ids", JSONB, nullable=False),
    Column("count", BigInteger, nullable=False),
    Column("reason", Text, nullable=False),
    # who ran it, as the client says (`user@host`: the OS user, which LOGNAME can fake)
    Column("actor", Text, nullable=False),
    # schema version 5: the database role that wrote the row (`current_user`, taken
    # by the insert on the server; NULL in rows written before), and the names of
    # the group and the topic, so the trail outlives them (decision 0033)
    Column("role", Text, server_default=text("CURRENT_USER")),
    Column("group_name", Text),
    Column("topic", Text),
)
"""Who changed rows by hand, and why: requeue, purge, unsubscribe, delete-topic."""

NO_GROUP = 0
"""`audit.group_id` of a row about a topic rather than a group."""

STATES: tuple[str, ...] = tuple(s.value for s in RowState)
ERROR_CLASSES: tuple[str, ...] = tuple(c.value for c in ErrorClass)
"""Plain strings (`click.Choice` would read enum members by their names)."""

# State words rendered as SQL literals, not bind parameters: with parameters, a
# prepared statement's generic plan could not use the partial indexes above.
READY = literal_column(_word(RowState.READY), Text)
LEASED = literal_column(_word(RowState.LEASED), Text)
DONE = literal_column(_word(RowState.DONE), Text)
DEAD = literal_column(_word(RowState.DEAD), Text)
SYSTEMIC = literal_column(_word(ErrorClass.SYSTEMIC), Text)
OPEN = literal_column(_word(BreakerState.OPEN), Text)
CLOSED = literal_column(_word(BreakerState.CLOSED), Text)
LOCAL_OPEN = literal_column(_word(LocalBreakerState.OPEN), Text)
