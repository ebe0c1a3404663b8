"""The maintenance thread: periodic housekeeping on the member's `work` connection.

The expired-lease sweep, the frontier advance, statistics, pruning, retention,
forgetting departed members and the handler-timeout watchdog run as small task
objects on a scheduler (psycopg_pool's maintenance style): a task that fails logs
and the loop goes on. A task the database refuses for good (a missing privilege,
the schema gone, the login refused) stops the member instead: it could never do
its job, and `Consumer.run()` raises that error (`refused`) once the member is down.

Housekeeping may wait for locks that other sessions hold (retention waits for a
caller's open `subscribe`, ANALYZE for a VACUUM): its transactions give up after
`HOUSEKEEPING_LOCK_TIMEOUT`, and the pass is tried again at its next period. Lease
extension is not here: it runs on the heartbeat's thread and connection
(`heartbeat.py`, decision 0025), where no housekeeping statement can delay it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pgq.consumer.member import REFUSALS, Member, Role
from pgq.errors import DatabaseUnavailable, LockNotAvailable, PgqError, TransactionConflict
from pgq.logcontext import carrying, get_logger
from pgq.store import RoleConnection
from pgq.store.housekeeping import EXPIRE_BATCH
from pgq.store.members import forget_departed

logger = get_logger("pgq.consumer")

EXPIRE_BUDGET = 2.0
"""Seconds one retention pass may spend deleting (it runs every minute)."""

FINAL_RETENTION_MIN = 0.5
"""Seconds the final pass gives a retention pass the run owes, even when the
shutdown deadline has passed (handlers overran it)."""

HOUSEKEEPING_LOCK_TIMEOUT = 3.0
"""Seconds a housekeeping statement waits for a lock (`lock_timeout`) before its
pass gives up until the next period: a caller's transaction that holds the topic
(an open `subscribe`) must not stall the maintenance thread."""


@dataclass(slots=True)
class Task:
    """A periodic job: `run()` every `interval` seconds."""

    name: str
    interval: float
    run: Callable[[], object]
    due: float = 0.0
    failing: bool = False


def run_task(task: Task, member: Member, thread: str) -> None:
    """Run `task` once under the task policy: an error is logged and the task is
    tried again at its next period; a lost conflict (a lock not granted within the
    lock timeout, a deadlock) defers it; a refusal (`REFUSALS`) stops the member."""
    try:
        task.run()
    except REFUSALS as exc:
        if not task.failing:  # the other tasks go on until the member is down
            task.failing = True
            member.refuse(f"{thread}:{task.name}", exc)
        return
    except DatabaseUnavailable as exc:
        if not task.failing:
            logger.warning("maintenance task failed task=%s error=%s", task.name, exc)
        task.failing = True
        return
    except TransactionConflict as exc:
        reason = "lock_timeout" if isinstance(exc, LockNotAvailable) else "conflict"
        logger.log(
            logging.INFO if task.failing else logging.WARNING,
            "maintenance task deferred task=%s reason=%s group=%s member=%s error=%s",
            task.name,
            reason,
            member.store.group,
            member.name,
            exc,
        )
        task.failing = True
        return
    except Exception:
        logger.exception("maintenance task failed task=%s", task.name)
        task.failing = True
        return
    if task.failing:
        logger.info("maintenance task recovered task=%s", task.name)
    task.failing = False


class Maintenance(Role):
    """Runs the member's periodic tasks until `finish` is set."""

    def __init__(self, member: Member, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(member, "pgq-maintenance")
        self.clock = clock
        self.finish = threading.Event()
        self._wake = threading.Event()
        self.conn = RoleConnection(
            member.links.work, "maintenance", self.finish, lock_timeout=HOUSEKEEPING_LOCK_TIMEOUT
        )
        self.vacuum_conn = RoleConnection(member.links.claims, "vacuum", self.finish)
        self._vacuuming: threading.Thread | None = None
        self.tasks: list[Task] = []
        self._retention_cut = False
        """The last retention pass was cut short by the stop."""

    def add(
        self, name: str, interval: float, run: Callable[[], object], *, first_in: float = 0.0
    ) -> None:
        """Schedule `run` every `interval` seconds (the first run `first_in` seconds
        from now: at once by default)."""
        self.tasks.append(Task(name, interval, run, self.clock() + first_in if first_in else 0.0))

    def work(self) -> None:
        try:
            while not self.finish.is_set():
                wait = self.run_due()
                self._wake.wait(min(1.0, wait))
        finally:
            self.conn.close()

    def run_due(self) -> float:
        """Run every task that is due (in the order added); return seconds to the next."""
        now = self.clock()
        for task in self.tasks:
            if now >= task.due:
                self._run_task(task)
                task.due = self.clock() + task.interval
        next_due = min((t.due for t in self.tasks), default=now + 1.0)
        return max(0.0, next_due - self.clock())

    def stop(self) -> None:
        """Leave after the current round; a VACUUM still running is cancelled, on a
        thread of its own (the cancel request needs a connection of its own, which
        may hang while the database is away: stopping must never wait for it)."""
        self.finish.set()
        if self._vacuuming is not None and self._vacuuming.is_alive():
            cancel = threading.Thread(
                target=carrying(self.vacuum_conn.cancel), name="pgq-vacuum-cancel", daemon=True
            )
            cancel.start()
        self._wake.set()

    def _run_task(self, task: Task) -> None:
        run_task(task, self.member, "maintenance")

    # -- the standard tasks ---------------------------------------------------

    def sweep(self) -> None:
        """Reclaim rows whose lease expired without an outcome."""
        m = self.member
        swept = self.conn.run(m.store.sweep)
        if swept.reclaimed:
            logger.info("reclaimed expired leases count=%d dead=%d", swept.reclaimed, swept.dead)
            m.count_reclaimed(swept.reclaimed)

    def advance_frontier(self) -> None:
        self.conn.run(self.member.store.advance_frontier)

    def refresh_statistics(self) -> None:
        self.conn.run(self.member.store.refresh_statistics)

    def vacuum(self) -> None:
        """VACUUM `delivery` when dead row versions dominate it, on a thread of its
        own, on the claims connection: a VACUUM may take longer than the lease.
        Lease extension (the session connection's), outcomes and housekeeping (the
        `work` connection's) go on meanwhile; the member claims nothing until it
        ends (decision 0027)."""
        if self._vacuuming is not None and self._vacuuming.is_alive():
            return
        self._vacuuming = threading.Thread(
            target=carrying(self._vacuum), name="pgq-vacuum", daemon=True
        )
        self._vacuuming.start()

    def _vacuum(self) -> None:
        try:
            self.vacuum_conn.run(self.member.store.vacuum_dead_rows, single=True)
        except Exception as exc:  # a failed vacuum must not stop the member
            if not self.finish.is_set():
                logger.warning("vacuum of delivery failed error=%s", exc)
        finally:
            self.vacuum_conn.close()

    def prune(self) -> None:
        self.conn.run(self.member.store.prune_behind)

    def expire_messages(self) -> None:
        """A retention pass on this thread's connection; one that the stop cuts
        short is the final pass's to run (`retention_owed`)."""
        self._retention_cut = True  # until the pass completes
        self._retention_cut = not self.retention_pass(self.conn, self.finish, EXPIRE_BUDGET)

    def retention_pass(self, conn: RoleConnection, stop: threading.Event, budget: float) -> bool:
        """Delete the group's logged probes and history lines past retention (one batch
        each) and its chart samples older than a day (`SAMPLE_KEEP`), then messages
        past retention, batch after batch, for up to `budget` seconds; False when
        `stop` cut it short."""
        m = self.member
        conn.run(m.store.expire_probes, m.settings.retention)
        conn.run(m.store.expire_history, m.settings.retention)
        conn.run(m.store.expire_samples)
        deadline = self.clock() + budget
        while self.clock() < deadline:
            if stop.is_set():
                return False
            if conn.run(m.store.expire_messages, m.topic_id, m.settings.retention) < EXPIRE_BATCH:
                break
        return True

    def retention_owed(self) -> bool:
        """Whether the member was due a retention pass that did not complete: the
        first never ran (a run that drains in milliseconds stops before its first
        round gets there), one came due since, failed, or the stop cut it short."""
        task = next((t for t in self.tasks if t.run == self.expire_messages), None)
        if task is None:
            return False
        return self._retention_cut or task.failing or self.clock() >= task.due

    def final_retention(self, left: float) -> None:
        """Run the retention pass the member owes (`retention_owed`) once this thread
        is down (DESIGN §7: a last maintenance pass runs before a run returns):
        prune the done rows behind the frontier, then expire, for the `left`
        seconds of the shutdown deadline (at least `FINAL_RETENTION_MIN`, at most
        `EXPIRE_BUDGET`), on a connection whose statements wait for a lock no longer
        than that. A pass that cannot get its locks in time is skipped with a log
        line, never waited for; a refusal stops the member as in the thread."""
        m = self.member
        if m.refused is not None or not self.retention_owed():
            return
        budget = min(EXPIRE_BUDGET, max(FINAL_RETENTION_MIN, left))
        wait = min(HOUSEKEEPING_LOCK_TIMEOUT, budget)
        conn = RoleConnection(m.links.claims, "final", threading.Event(), lock_timeout=wait)
        try:
            conn.run(m.store.prune_behind)
            self.retention_pass(conn, threading.Event(), budget)
        except REFUSALS as exc:
            m.refuse("final:retention", exc)
        except PgqError as exc:
            reason = "lock_timeout" if isinstance(exc, LockNotAvailable) else "error"
            logger.warning(
                "final retention skipped reason=%s group=%s member=%s error=%s",
                reason,
                m.store.group,
                m.name,
                exc,
            )
        finally:
            conn.close()

    def sample(self) -> None:
        """Write this minute's chart sample of the group unless one is there."""
        self.conn.run(self.member.store.take_sample)

    def forget_members(self) -> None:
        """Delete the group's members that left or died longer than
        `breaker.member_retention` ago (every `--until-empty` run leaves one behind)."""
        m = self.member
        gone = self.conn.run(forget_departed, m.store.gid, m.settings.breaker_member_retention)
        if gone:
            logger.info("forgot departed members count=%d", len(gone))
