"""The database boundary: driver errors become pgq's own exceptions here.

Everything that talks to PostgreSQL runs inside `wrap_errors()`, so threads,
the breaker logic and the CLI never see a psycopg or SQLAlchemy exception type.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar, cast

import psycopg
import psycopg.errors
from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import ClauseElement, Executable
from tenacity import Retrying, retry_if_exception, wait_exponential

from pgq.connect import first_line, schema_of
from pgq.errors import BadDsn, DatabaseUnavailable, PgqError, SchemaMissing
from pgq.message import Message
from pgq.schema import SCHEMA_PLACEHOLDER
from pgq.sql import breaker as breaker_sql
from pgq.sql import claim as claim_sql
from pgq.sql import frontier as frontier_sql
from pgq.sql import members as member_sql
from pgq.sql import outcomes as outcome_sql
from pgq.sql import stats as stats_sql
from pgq.sql.locks import lock_key, try_xact_lock

if TYPE_CHECKING:
    from pgq.consumer.model import Claimed, Outcome

logger = logging.getLogger(__name__)
T = TypeVar("T")

# SQLSTATE classes that mean "the server or the connection is gone or refusing":
# 08 connection exception, 57P01-57P03 shutdown/cannot connect now, 53 resources.
_UNAVAILABLE_PREFIXES = ("08", "57P", "53")
# 28 invalid authorization, 3D000 invalid catalog (no such database)
_BAD_ADDRESS_PREFIXES = ("28", "3D")


def _driver_error(exc: BaseException) -> BaseException:
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def translate(exc: BaseException) -> PgqError | None:
    """The pgq exception for a driver exception, or None if it is not one we map."""
    err = _driver_error(exc)
    sqlstate = getattr(err, "sqlstate", None) or ""
    if isinstance(err, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName):
        return SchemaMissing()
    if sqlstate.startswith(_BAD_ADDRESS_PREFIXES):
        return BadDsn(f"cannot use the database: {first_line(err)}")
    if isinstance(err, psycopg.OperationalError | psycopg.InterfaceError) or sqlstate.startswith(
        _UNAVAILABLE_PREFIXES
    ):
        return DatabaseUnavailable(f"cannot reach the database: {first_line(err)}")
    if isinstance(exc, sa_exc.DisconnectionError | sa_exc.TimeoutError):
        return DatabaseUnavailable(f"cannot reach the database: {first_line(exc)}")
    return None


@contextlib.contextmanager
def wrap_errors() -> Iterator[None]:
    """Re-raise driver errors as `DatabaseUnavailable`, `BadDsn` or `SchemaMissing`."""
    try:
        yield
    except (sa_exc.DBAPIError, sa_exc.DisconnectionError, sa_exc.TimeoutError, psycopg.Error) as e:
        mapped = translate(e)
        if mapped is None:
            raise
        raise mapped from e


class RoleConnection:
    """The one connection a consumer thread role owns.

    `run(fn)` calls `fn(conn)` inside a transaction. When the database is
    unreachable the connection is thrown away (the next call opens a new one)
    and `DatabaseUnavailable` is raised; `retrying(fn)` retries that with
    exponential backoff until it works or `stop` is set.
    """

    def __init__(self, engine: Engine, role: str, stop: threading.Event) -> None:
        self.engine = engine
        self.role = role
        self.stop = stop
        self._conn: Connection | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in one transaction on this role's connection."""
        try:
            with wrap_errors():
                if self._conn is None:
                    self._conn = self.engine.connect()
                with self._conn.begin():
                    return fn(self._conn, *args)
        except DatabaseUnavailable:
            self._discard()
            raise

    def retrying(self, fn: Callable[..., T], *args: Any) -> T:
        """`run(fn, *args)`, retried with backoff while the database is unavailable.

        Gives up (re-raising) once the role's stop event is set.
        """
        try:
            return self.run(fn, *args)  # the common case, without tenacity's overhead
        except DatabaseUnavailable as exc:
            if self.stop.is_set() or isinstance(exc, BadDsn):
                raise
        gate = self.stop

        def nap(seconds: float) -> None:
            gate.wait(seconds)  # a stop ends the wait at once

        retryer = Retrying(
            # an address the server refuses (no such database, bad login) is not
            # an outage: retrying would not help
            retry=retry_if_exception(
                lambda e: isinstance(e, DatabaseUnavailable) and not isinstance(e, BadDsn)
            ),
            wait=wait_exponential(multiplier=0.1, max=5.0),
            stop=lambda state: gate.is_set(),
            sleep=nap,
            before_sleep=lambda state: logger.warning(
                "database unavailable role=%s attempt=%d error=%s",
                self.role,
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
            reraise=True,
        )
        return retryer(self.run, fn, *args)

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.invalidate()
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        """Return the connection (if any) to the pool."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


ERROR_TEXT_MAX = 2000

STATS_MIN_CHANGES = 1000
STATS_CHANGED_SHARE = 0.2
STATS_MIN_AGE = 30.0
"""ANALYZE delivery when at least 1,000 rows and 20 % of it changed since the last
analyze, and that one is at least 30 s old (see `pgq.sql.stats`)."""

EXPIRE_BATCH = 5000
"""Messages one retention statement deletes at most (one short transaction each)."""

_compiled: dict[tuple[int, str], tuple[str, dict[str, Any]]] = {}


def run_hot(conn: Connection, stmt: Executable, params: dict[str, Any]) -> list[Any]:
    """Run a hot-path statement on the connection's psycopg cursor.

    The Core statement is compiled once per schema (with the schema rendered
    in), so each call skips SQLAlchemy's per-execution work; it still runs in
    the SQLAlchemy connection's transaction. Returns the rows as tuples.
    """
    schema = schema_of(conn)
    key = (id(stmt), schema)
    hit = _compiled.get(key)
    if hit is None:
        compiled = cast(ClauseElement, stmt).compile(
            dialect=conn.dialect,
            schema_translate_map={SCHEMA_PLACEHOLDER: schema},
            render_schema_translate=True,
        )
        hit = _compiled[key] = (compiled.string, dict(compiled.params))
    sql, defaults = hit
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cur:
        # prepared after a few calls (psycopg's default): planning the claim anew
        # each time costs ~1 ms of server CPU per batch. The plan is only as good
        # as the table's statistics, which the maintenance thread keeps fresh.
        cur.execute(sql, {**defaults, **params})
        return cur.fetchall() if cur.description else []


@dataclass(frozen=True, slots=True)
class DrainState:
    """What stands between a member and an empty group (see `sql.members.drain_state`)."""

    ready_now: int
    waiting_retry: int
    held: int


@dataclass(frozen=True, slots=True)
class BreakerView:
    """The group breaker as stored: state, epoch, whether a probe is due, and any
    reconciliation still owed (`reconcile_epoch`, refunding from `reconcile_from`)."""

    state: str
    epoch: int
    probe_due: bool
    reconcile_epoch: int | None
    reconcile_from: int | None
    probe_failures: int


@dataclass(frozen=True, slots=True)
class Sweep:
    """Rows one sweep took back from expired leases."""

    reclaimed: int
    dead: int


class GroupStore:
    """The consumer's statements for one group and member, run on a role's connection."""

    def __init__(
        self, gid: int, group: str, topic: str, member: str, lease: float, max_reclaims: int
    ) -> None:
        self.gid = gid
        self.group = group
        self.topic = topic
        self.member = member
        self.lease = dt.timedelta(seconds=lease)
        self.max_reclaims = max_reclaims

    # -- claim path ---------------------------------------------------------

    def claim(self, conn: Connection, limit: int, epoch: int) -> list[Claimed]:
        """Lease up to `limit` ready rows to this member (rounded down to a power of two
        below 64, so only a few claim statements are ever prepared)."""
        if limit < 1:
            return []
        if limit < 64:
            limit = 1 << (limit.bit_length() - 1)
        params = {"gid": self.gid, "member": self.member, "lease": self.lease}
        return self._claimed(run_hot(conn, claim_sql.claim(limit), params), epoch)

    def claim_probe(self, conn: Connection, epoch: int) -> Claimed | None:
        """Lease the group probe: a ready row (due soonest), else the oldest dead systemic row."""
        params = {"gid": self.gid, "member": self.member, "lease": self.lease}
        rows = conn.execute(breaker_sql.claim_probe_ready(), params).all()
        if not rows:
            rows = conn.execute(breaker_sql.claim_probe_dead(), params).all()
        claimed = self._claimed(rows, epoch)
        return claimed[0] if claimed else None

    def probe_done(self, conn: Connection, row: Claimed) -> bool:
        """Write a successful group probe (refunding its systemic charges)."""
        params = {"gid": self.gid, "id": row.id, "seq": row.seq, "member": self.member}
        return conn.execute(breaker_sql.probe_done(), params).one_or_none() is not None

    def _claimed(self, rows: Any, epoch: int) -> list[Claimed]:
        from pgq.consumer.model import Claimed

        group, topic, loads = self.group, self.topic, json.loads
        return [
            Claimed(
                Message(
                    r[0], topic, group, r[3], loads(r[4]), r[5] and loads(r[5]), r[2] + 1, r[6]
                ),
                r[1],
                r[2],
                epoch,
            )
            for r in rows
        ]

    def extend(self, conn: Connection, leases: list[tuple[int, int]]) -> set[int]:
        """Extend the given leases; returns the ids still held."""
        ids, seqs = _split(leases)
        rows = conn.execute(
            claim_sql.extend_leases(),
            {"gid": self.gid, "ids": ids, "seqs": seqs, "member": self.member, "lease": self.lease},
        )
        return {r[0] for r in rows}

    def release(self, conn: Connection, leases: list[tuple[int, int]]) -> int:
        """Hand unstarted leased rows back to ready, uncharged; returns how many."""
        if not leases:
            return 0
        ids, seqs = _split(leases)
        params = {"gid": self.gid, "ids": ids, "seqs": seqs, "member": self.member}
        n = len(conn.execute(claim_sql.release(), params).all())
        if n:
            conn.execute(claim_sql.add_to_total("released_total"), {"gid": self.gid, "n": n})
        return n

    def sweep(self, conn: Connection, limit: int = 1000) -> Sweep:
        """Reclaim rows whose lease expired without an outcome."""
        rows = conn.execute(
            claim_sql.sweep_expired(),
            {"gid": self.gid, "limit": limit, "max_reclaims": self.max_reclaims},
        ).all()
        if rows:
            conn.execute(
                claim_sql.add_to_total("reclaimed_total"), {"gid": self.gid, "n": len(rows)}
            )
        return Sweep(len(rows), sum(1 for r in rows if r[1] == "dead"))

    # -- outcomes -----------------------------------------------------------

    def record(self, conn: Connection, outcomes: list[Outcome]) -> set[int]:
        """Write a batch of outcomes in this transaction; returns the ids applied."""
        done = [o.claimed for o in outcomes if o.kind == "done"]
        failed = [o for o in outcomes if o.kind != "done"]
        applied: set[int] = set()
        if done:
            params = {
                "gid": self.gid,
                "ids": int_array(row.message.id for row in done),
                "seqs": int_array(row.seq for row in done),
                "member": self.member,
            }
            applied.update(r[0] for r in run_hot(conn, outcome_sql.ack_done(), params))
        if failed:
            params = {
                "gid": self.gid,
                "member": self.member,
                "ids": [o.claimed.id for o in failed],
                "seqs": [o.claimed.seq for o in failed],
                "states": ["dead" if o.kind == "dead" else "ready" for o in failed],
                "charges": [0 if o.kind == "snooze" else 1 for o in failed],
                "delays": [o.delay for o in failed],
                "classes": [o.error_class for o in failed],
                "errors": [(o.error or "")[:ERROR_TEXT_MAX] for o in failed],
                "epochs": [o.claimed.epoch for o in failed],
            }
            applied.update(r[0] for r in run_hot(conn, outcome_sql.record_failures(), params))
        return applied

    # -- group breaker --------------------------------------------------------

    def breaker(self, conn: Connection) -> BreakerView:
        """The group breaker row."""
        r = conn.execute(breaker_sql.state(), {"gid": self.gid}).one()
        return BreakerView(str(r[0]), int(r[1]), bool(r[2]), r[3], r[4], int(r[5]))

    def open_on_quorum(self, conn: Connection, epoch: int, s: Any) -> int | None:
        """Open the group if the quorum of live tripped members is there; the new epoch."""
        return conn.execute(
            breaker_sql.open_on_quorum(),
            {
                "gid": self.gid,
                "at_epoch": epoch,
                "member": self.member,
                "ttl": dt.timedelta(seconds=s.breaker_member_ttl),
                "min_members": s.breaker_min_members,
                "quorum": Decimal(str(s.breaker_quorum)),
            },
        ).scalar()

    def set_prober(self, conn: Connection) -> None:
        conn.execute(breaker_sql.set_prober(), {"gid": self.gid, "member": self.member})

    def probe_failed(self, conn: Connection, epoch: int, delay: float) -> int | None:
        """Back the next probe off by `delay`; returns the consecutive failure count."""
        params = {"gid": self.gid, "at_epoch": epoch, "delay": dt.timedelta(seconds=delay)}
        return conn.execute(breaker_sql.probe_failed(), params).scalar()

    def close(self, conn: Connection, epoch: int) -> int | None:
        """Close the group if still OPEN at `epoch`; returns the close epoch."""
        params = {"gid": self.gid, "at_epoch": epoch, "member": self.member}
        return conn.execute(breaker_sql.close(), params).scalar()

    def reconcile_batch(
        self, conn: Connection, close_epoch: int, from_epoch: int, max_refunds: int, limit: int
    ) -> int:
        """Refund one batch of systemic rows for this close; returns how many."""
        params = {
            "gid": self.gid,
            "close_epoch": close_epoch,
            "from_epoch": from_epoch,
            "max_refunds": max_refunds,
            "limit": limit,
        }
        return int(conn.execute(breaker_sql.reconcile_batch(), params).scalar() or 0)

    def reconcile_done(self, conn: Connection, close_epoch: int) -> None:
        conn.execute(breaker_sql.reconcile_done(), {"gid": self.gid, "close_epoch": close_epoch})

    # -- frontier and housekeeping -------------------------------------------

    def advance_frontier(self, conn: Connection) -> int | None:
        """Advance the committed frontier as far as it may go; returns rows pruned,
        or None when another member holds the group row right now."""
        frontier = conn.execute(frontier_sql.lock_group(), {"gid": self.gid}).one_or_none()
        if frontier is None:
            return None
        here = {"gid": self.gid, "cx": frontier[0], "cid": frontier[1] or 0}
        stop = conn.execute(frontier_sql.first_unresolved(), here).one_or_none()
        if stop is None:
            new = conn.execute(frontier_sql.last_committed(), here).one_or_none()
        else:
            new = conn.execute(
                frontier_sql.last_resolved(), {**here, "ux": stop[0], "uid": stop[1]}
            ).one_or_none()
        if new is None:
            return 0
        return int(
            conn.execute(frontier_sql.advance(), {**here, "nx": new[0], "nid": new[1]}).scalar()
            or 0
        )

    def refresh_statistics(self, conn: Connection) -> bool:
        """ANALYZE the delivery table when it changed a lot since its statistics were
        taken (one member at a time); returns whether it did."""
        schema = schema_of(conn)
        row = conn.execute(
            stats_sql.delivery_changes(), {"relation": f'"{schema}".delivery'}
        ).one_or_none()
        if row is None:
            return False
        changed, live, age = int(row[0] or 0), int(row[1] or 0), row[2]
        if changed < STATS_MIN_CHANGES or changed < STATS_CHANGED_SHARE * live:
            return False
        if age is not None and float(age) < STATS_MIN_AGE:
            return False
        if not conn.execute(try_xact_lock(lock_key(schema, "analyze"))).scalar():
            return False
        driver = conn.connection.driver_connection
        assert driver is not None
        driver.execute(stats_sql.analyze(schema))
        logger.info("analyzed delivery schema=%s changed=%d live=%d", schema, changed, live)
        return True

    def prune_behind(self, conn: Connection) -> int:
        """Prune done rows that finished behind the frontier after it passed them."""
        return int(conn.execute(frontier_sql.prune_behind(), {"gid": self.gid}).scalar() or 0)

    def expire_messages(
        self, conn: Connection, topic_id: int, retention: float, limit: int = EXPIRE_BATCH
    ) -> int:
        """Delete one batch of messages past retention that no group still holds."""
        rows = conn.execute(
            frontier_sql.delete_expired_messages(),
            {"topic_id": topic_id, "retention": dt.timedelta(seconds=retention), "limit": limit},
        ).all()
        return len(rows)

    # -- membership -----------------------------------------------------------

    def join(self, conn: Connection, ttl: float) -> bool:
        """Register this member; False when a live member already has the name."""
        row = conn.execute(
            member_sql.join(),
            {
                "gid": self.gid,
                "member": self.member,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "ttl": dt.timedelta(seconds=ttl),
            },
        ).one_or_none()
        return row is not None

    def heartbeat(self, conn: Connection, local: str, tripped_epoch: int | None) -> tuple[str, int]:
        """Record liveness and local breaker state; returns (group state, epoch)."""
        row = conn.execute(
            member_sql.heartbeat(),
            {
                "gid": self.gid,
                "member": self.member,
                "local": local,
                "tripped_epoch": tripped_epoch,
            },
        ).one()
        return str(row[0]), int(row[1])

    def leave(self, conn: Connection) -> None:
        """Mark this member as gone."""
        conn.execute(member_sql.leave(), {"gid": self.gid, "member": self.member})

    def drain_state(self, conn: Connection, ttl: float) -> DrainState:
        """Rows ready now, waiting for retry, and leased by us or by silent members."""
        row = conn.execute(
            member_sql.drain_state(),
            {"gid": self.gid, "member": self.member, "ttl": dt.timedelta(seconds=ttl)},
        ).one()
        return DrainState(int(row[0]), int(row[1]), int(row[2]))


def int_array(values: Iterable[int]) -> str:
    """An integer array as PostgreSQL's text literal: one string for the driver to
    send, instead of a list it would adapt element by element."""
    return "{" + ",".join(map(str, values)) + "}"


def _split(leases: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [lease[0] for lease in leases], [lease[1] for lease in leases]


def run_once(engine: Engine, fn: Callable[..., T], *args: Any) -> T:
    """`fn(conn, *args)` in one transaction on a pooled connection."""
    with wrap_errors(), engine.begin() as conn:
        return fn(conn, *args)
