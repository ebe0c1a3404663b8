"""Is a schema placed on a Citus cluster? Asked once per process and schema.

A few statements take another shape on Citus (decision 0023): the claim reads the
messages in a statement of its own, and the topic locks are the coordinator's
advisory locks, not row locks on a reference table. Everything else is one code
base. A schema is distributed when its `delivery` table is (`pgq init --distributed`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import threading
import time
from collections.abc import Iterable, Iterator

from sqlalchemy import Connection, Engine

from pgq.errors import PgqError
from pgq.logcontext import get_logger
from pgq.sql import placement as place
from pgq.store.engine import conninfo_of, schema_of

logger = get_logger("pgq.store")

_known: dict[tuple[str, str], bool] = {}
_lock = threading.Lock()


def distributed(bind: Engine | Connection) -> bool:
    """True when the schema of `bind` (an engine, or a connection, asked on itself) is
    placed on Citus (cached for the process)."""
    key = _key(bind)
    with _lock:
        known = _known.get(key)
    if known is not None:
        return known
    delivery = f'"{key[1]}".delivery'
    if isinstance(bind, Engine):
        with bind.connect() as c:
            answer = bool(_ask(c, delivery))
    else:
        answer = bool(_ask(bind, delivery))
    with _lock:
        _known[key] = answer
    return answer


def _key(bind: Engine | Connection) -> tuple[str, str]:
    conninfo = bind.get_execution_options().get("pgq_conninfo")
    if conninfo is None:  # an engine not made by `pgq.connect`
        engine = bind if isinstance(bind, Engine) else bind.engine
        conninfo = conninfo_of(engine)
    return str(conninfo), schema_of(bind)


def _ask(conn: Connection, delivery: str) -> bool:
    """Asked on the driver's cursor: the connection may be a hot-path one running in
    autocommit (`pgq.store.connections.run_hot`), where a SQLAlchemy statement would
    begin a transaction of its own."""
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cur:
        cur.execute("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL")
        row = cur.fetchone()
        if not (row and row[0]):
            return False
        cur.execute(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition"
            " WHERE logicalrelid = to_regclass(%s))",
            (delivery,),
        )
        row = cur.fetchone()
        return bool(row and row[0])


def forget(engine: Engine) -> None:
    """Drop what is known of `engine`'s schema (after `migrate(distributed=True)`)."""
    with _lock:
        _known.pop(_key(engine), None)


def nodes_committing(conn: Connection, before: dt.datetime) -> set[tuple[str, int]]:
    """The workers where a transaction of this database prepared before `before` is
    not yet committed (`place.pending_commits`); a worker that does not answer
    counts as one.

    A distributed transaction becomes visible node by node: its parts are
    prepared everywhere, then committed one node after the other. Between the
    two, or for as long as a cut leaves a part in doubt, a message can be visible
    on its topic's node while its delivery rows are not on a group's node, or the
    other way round (tests/citus/test_two_phase.py)."""
    rows = conn.execute(place.on_workers(), {"command": place.pending_commits(before)})
    return {(r.nodename, r.nodeport) for r in rows if not (r.success and r.result == "0")}


def nodes_of(conn: Connection, table: str, values: Iterable[int]) -> dict[int, tuple[str, int]]:
    """The worker holding the shard of `table` (a qualified name) for each
    distribution value of `values`."""
    rows = conn.execute(place.shard_nodes(), {"values": list(values), "table": table})
    return {r.value: (r.nodename, r.nodeport) for r in rows}


def cutoff(conn: Connection) -> dt.datetime:
    """`place.cutoff`: a time after which nothing prepared is part of what was read."""
    at = conn.execute(place.cutoff()).scalar_one()
    if not isinstance(at, dt.datetime):
        raise PgqError(f"the cutoff time came back as {type(at).__name__}")
    return at


def wait_for_commits(conn: Connection, before: dt.datetime, what: str) -> None:
    """Wait until no transaction prepared on a worker before `before` is left
    uncommitted; after 2 s ask Citus to recover those in doubt
    (`place.recover_prepared`: a part a cut left prepared otherwise waits for
    `citus.recover_2pc_interval`, a minute by default, and holds its locks);
    `PgqError` after `COMMIT_WAIT` seconds."""
    start = time.monotonic()
    recovered = False
    while pending := nodes_committing(conn, before):
        waited = time.monotonic() - start
        nodes = ", ".join(f"{host}:{port}" for host, port in sorted(pending))
        if waited > COMMIT_WAIT:
            raise PgqError(
                f"{what} waited {COMMIT_WAIT:g} s for two-phase commits on {nodes} to"
                " finish; try again, or run SELECT recover_prepared_transactions()"
                " on the coordinator"
            )
        if waited > 2.0 and not recovered:
            logger.warning("two-phase commit unresolved nodes=%s waiting=%s", nodes, what)
            conn.execute(place.recover_prepared())
            recovered = True
        time.sleep(0.05)


COMMIT_WAIT = 30.0
"""Seconds a subscribe waits for the publishes before it to commit on every node."""


class Spanning(enum.Enum):
    """The statements of pgq that run on several shards of a Citus cluster, by name.

    Everything else pgq sends touches one group's rows (or one topic's messages) and
    runs as one task on the node that holds them; CI runs the Citus suite with
    `citus.multi_task_query_log_level = error`, so a statement that would not fails
    there. These are the exceptions: reports and admin statements that read (or a
    subscribe, write from) every group or topic at once. Each runs inside
    `spanning(conn, Spanning.X)`; `tests/unit/test_spanning_names.py` lists them, so one more
    is a decision, not an accident. The value says why it spans.
    """

    SUBSCRIBE_BACKFILL = (
        "a subscribe reads the delays of its topic's messages from every group's rows"
    )
    GROUPS_OVERVIEW = "`pgq status` and the dashboard without a group: every group's row and counts"
    MEMBERS_OVERVIEW = "the members of every group (`pgq status`, the dashboard, `pgq members`)"
    SAMPLES_OVERVIEW = "the charts of every group (the dashboard's overview)"
    TOPIC_MESSAGE_COUNTS = "`pgq topics`: how many messages each topic retains"
    AUDIT_BY_NAME = "the audit trail of a topic, or of a group by name (deleted groups too)"
    UPGRADE = "a migration of a placed schema rewrites every group's rows once (`pgq init`)"


@contextlib.contextmanager
def spanning(conn: Connection, name: Spanning) -> Iterator[None]:
    """Run the statements of this block, in `conn`'s transaction, as `name` says: on
    Citus with `citus.multi_task_query_log_level` off, set back after the block (a
    block that raises leaves it off to the end of the transaction, which the error
    ends); on one server nothing changes."""
    if not distributed(conn):
        yield
        return
    before = conn.execute(place.allow_multi_task()).scalar_one()
    logger.debug("spanning statement name=%s", name.name)
    yield
    conn.execute(place.restore_multi_task(), {"before": before})
