"""Housekeeping in `GroupStore`: the frontier, statistics, VACUUM and retention."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection

from pgq.logcontext import get_logger
from pgq.read_models import GroupSample
from pgq.sql import frontier as frontier_sql
from pgq.sql import history as history_sql
from pgq.sql import locks as locks_sql
from pgq.sql import stats as stats_sql
from pgq.sql.locks import (
    lock_key,
    try_xact_lock,
)
from pgq.store import placement
from pgq.store import samples as store_samples
from pgq.store.connections import run_hot
from pgq.store.engine import schema_of
from pgq.store.scope import GroupScope

logger = get_logger("pgq.store")

STATS_MIN_CHANGES = 1000
STATS_CHANGED_SHARE = 0.2
STATS_MIN_AGE = 30.0
"""ANALYZE delivery when at least 1,000 rows and 20 % of it changed since the last
analyze, and that one is at least 30 s old (see `pgq.sql.stats`)."""
VACUUM_MIN_DEAD = 50_000
"""Dead rows in `delivery` before a member vacuums it (and they must outnumber the
live rows `VACUUM_DEAD_SHARE` times, or reach `VACUUM_ENOUGH_DEAD`)."""
VACUUM_DEAD_SHARE = 2.0
VACUUM_ENOUGH_DEAD = 200_000
"""Dead rows that call for a vacuum however many rows live: behind a big backlog
they sit at the head of the ready index, where every claim walks over them."""
VACUUM_MIN_AGE = 5.0
"""Seconds since the last vacuum (anyone's) before a member vacuums again."""

EXPIRE_BATCH = 5000
"""Messages one retention statement deletes at most (one short transaction each)."""


def vacuum_due(dead: int, live: int) -> bool:
    """Do `dead` row versions call for a VACUUM of a delivery table with `live` rows?
    (At least `VACUUM_MIN_DEAD`, and `VACUUM_DEAD_SHARE` times the live rows or
    `VACUUM_ENOUGH_DEAD`, whichever is less.)"""
    return dead >= max(VACUUM_MIN_DEAD, min(VACUUM_DEAD_SHARE * live, VACUUM_ENOUGH_DEAD))


class Housekeeping(GroupScope):
    """What keeps a group's tables small and its frontier current: the frontier's
    advance and prune, planner statistics, VACUUM, and retention of messages and
    probes."""

    def advance_frontier(self, conn: Connection) -> int | None:
        """Advance the committed frontier as far as it may go; returns rows pruned,
        or None when another member holds the group row right now.

        One statement, so the decision comes from one snapshot (see
        `frontier_sql.advance_frontier`)."""
        conn.execute(frontier_sql.without_jit())
        held, pruned, moved = conn.execute(frontier_sql.advance_frontier(), {"gid": self.gid}).one()
        if moved:
            self._rebase_frontier(conn)
            held, pruned, _ = conn.execute(frontier_sql.advance_frontier(), {"gid": self.gid}).one()
        return int(pruned) if held else None

    def _rebase_frontier(self, conn: Connection) -> None:
        """Start the frontier again in this server's xid space: the group's rows came
        from another server (`frontier_sql.rebase_frontier`, decision 0047)."""
        rows = conn.execute(frontier_sql.rebase_rows(), {"gid": self.gid}).scalar()
        rebased, was = conn.execute(frontier_sql.rebase_frontier(), {"gid": self.gid}).one()
        if rebased and was is not None:
            logger.warning(
                "frontier started again in this server's xids: the group's rows were"
                " written on another server (a shard move, a restore) group=%s was=%s"
                " rows=%d",
                self.group,
                was,
                rows,
            )

    def prune_behind(self, conn: Connection) -> int:
        """Prune done rows that finished behind the frontier after it passed them."""
        return int(conn.execute(frontier_sql.prune_behind(), {"gid": self.gid}).scalar() or 0)

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
        logger.debug("analyzed delivery schema=%s changed=%d live=%d", schema, changed, live)
        return True

    def vacuum_dead_rows(self, conn: Connection) -> bool:
        """VACUUM the delivery table when dead row versions dominate it and this
        session may (it owns the table); returns whether it did. Runs its statements
        on the driver: the caller runs it outside a transaction (`single=True`),
        which VACUUM needs."""
        schema = schema_of(conn)
        rows = run_hot(conn, stats_sql.delivery_dead(), {"relation": f'"{schema}".delivery'})
        if not rows:
            return False
        dead, live, age, may = int(rows[0][0] or 0), int(rows[0][1] or 0), rows[0][2], rows[0][3]
        if not may or not vacuum_due(dead, live):
            return False
        if age is not None and float(age) < VACUUM_MIN_AGE:
            return False
        driver = conn.connection.driver_connection
        assert driver is not None
        notices: list[str] = []

        def note(diagnostic: Any) -> None:
            notices.append(diagnostic.message_primary or "")

        driver.add_notice_handler(note)
        try:
            driver.execute(stats_sql.vacuum(schema))
        finally:
            driver.remove_notice_handler(note)
        if any(n.startswith("skipping") for n in notices):  # SKIP_LOCKED: another runs
            logger.info("vacuum of delivery skipped schema=%s (another vacuum runs)", schema)
            return False
        logger.info("vacuumed delivery schema=%s dead=%d live=%d", schema, dead, live)
        return True

    def expire_messages(
        self, conn: Connection, topic_id: int, retention: float, limit: int = EXPIRE_BATCH
    ) -> int:
        """Delete one batch of messages past retention that no group still holds;
        returns how many.

        Takes the topic lock first, in its own statement, so that retention and a
        subscribe's backfill never race (see `lock_topic_for_retention`). On Citus
        that lock is the coordinator's advisory lock (a row lock on the reference
        table `topic` would lock every topic), and the delete is three routed steps
        (`expired_candidates`, `held_by_group` per group, `delete_messages`): the
        one statement joins `message` and `delivery`, which Citus refuses.
        """
        params = {
            "topic_id": topic_id,
            "retention": dt.timedelta(seconds=retention),
            "limit": limit,
        }
        if not placement.distributed(conn):
            conn.execute(frontier_sql.lock_topic_for_retention(), {"topic_id": topic_id})
            return len(conn.execute(frontier_sql.delete_expired_messages(), params).all())
        key = locks_sql.topic_key(schema_of(conn), self.topic)
        conn.execute(locks_sql.topic_lock(shared=True), {"key": key})
        conn.execute(frontier_sql.without_jit())
        groups = conn.execute(frontier_sql.groups_of_topic(), params).scalars().all()
        nodes = set(placement.nodes_of(conn, f'"{schema_of(conn)}".delivery', groups).values())
        free: list[int] = []
        after = 0
        while len(free) < limit:
            page = conn.execute(frontier_sql.expired_candidates(), {**params, "after": after})
            ids = list(page.scalars())
            if not ids:
                break
            # a message seen committed may have its delivery rows still prepared on a
            # group's node (its commit reaches nodes one after the other): invisible to
            # `held_by_group`, and deleted under them (tests/citus/test_two_phase.py)
            if nodes & placement.nodes_committing(conn, placement.cutoff(conn)):
                logger.info("retention waits for two-phase commits topic=%s", self.topic)
                break
            after = ids[-1]
            free += self._unheld(conn, groups, ids)
        if not free:
            return 0
        victims = {"topic_id": topic_id, "ids": free[:limit]}
        return len(conn.execute(frontier_sql.delete_messages(), victims).all())

    @staticmethod
    def _unheld(conn: Connection, groups: Iterable[int], ids: list[int]) -> list[int]:
        """Of messages `ids`, those none of `groups` has a delivery row for: one
        routed statement per group, until none is left."""
        left = set(ids)
        for gid in groups:
            if not left:
                break
            held = conn.execute(frontier_sql.held_by_group(), {"gid": gid, "ids": sorted(left)})
            left.difference_update(held.scalars())
        return sorted(left)

    def expire_probes(self, conn: Connection, retention: float, limit: int = EXPIRE_BATCH) -> int:
        """Delete one batch of this group's logged probes older than `retention`
        seconds; returns how many."""
        params = {"gid": self.gid, "retention": dt.timedelta(seconds=retention), "limit": limit}
        return int(conn.execute(frontier_sql.delete_expired_probes(), params).scalar() or 0)

    def expire_history(self, conn: Connection, retention: float, limit: int = EXPIRE_BATCH) -> int:
        """Delete one batch of this group's history lines older than `retention`
        seconds; returns how many."""
        params = {"gid": self.gid, "retention": dt.timedelta(seconds=retention), "limit": limit}
        return int(conn.execute(history_sql.delete_expired_lines(), params).scalar() or 0)

    def take_sample(self, conn: Connection) -> GroupSample | None:
        """This minute's sample of the group for the charts, unless one is there
        (`pgq.store.samples.take_sample`)."""
        return store_samples.take_sample(conn, self.gid)

    def expire_samples(self, conn: Connection, keep: float = store_samples.SAMPLE_KEEP) -> int:
        """Delete the group's chart samples older than `keep` seconds; returns how many."""
        return store_samples.expire_samples(conn, self.gid, keep)
