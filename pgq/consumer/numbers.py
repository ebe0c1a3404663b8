"""The group's numbers a member's metrics serve, read on the member's own connection.

A scrape never reads the database (decision 0031): while metrics are served
(`Consumer.measure()`), a maintenance task reads the group's status and the
`pgq check` verdict every `REFRESH_EVERY` seconds on the `work` link (one of the
member's three named connections), with the member's own `breaker.member_ttl`
and `breaker.max_refunds`, and keeps the latest here; the collector answers
from it at once. While the database does not answer the snapshot only ages:
a scrape still answers (the member's own families, the snapshot's age), and
the group's families go once the snapshot is older than `STALE_AFTER`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from pgq import monitor
from pgq.errors import DatabaseUnavailable, PgqError, TransactionConflict
from pgq.logcontext import get_logger
from pgq.read_models import GroupStatus
from pgq.settings import Settings
from pgq.store import RoleConnection

__all__ = ["REFRESH_EVERY", "STALE_AFTER", "GroupNumbers", "Numbers"]

logger = get_logger("pgq.metrics")

REFRESH_EVERY = 5.0
"""Seconds between two reads of the group's numbers by a member serving metrics."""

STALE_AFTER = 30.0
"""Seconds after which a member's metrics no longer serve the group's numbers read
then (the snapshot's age is served either way)."""


@dataclass(frozen=True, slots=True)
class Numbers:
    """One read of the group's numbers: its status, the check's state word, and when
    (the member's monotonic clock)."""

    status: GroupStatus
    check: str
    taken: float


class GroupNumbers:
    """The latest `Numbers` of one member's group (written by the maintenance
    thread, read by scrapes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Numbers | None = None

    def latest(self) -> Numbers | None:
        with self._lock:
            return self._latest

    def put(self, numbers: Numbers) -> None:
        with self._lock:
            self._latest = numbers

    def refresher(
        self, conn: RoleConnection, group: str, settings: Settings, clock: Callable[[], float]
    ) -> Callable[[], None]:
        """The maintenance task: one read on `conn`, kept as the latest."""

        warned = False

        def refresh() -> None:
            nonlocal warned
            try:
                status, word = conn.run(
                    lambda c: monitor.group_numbers(
                        c,
                        group,
                        member_ttl=settings.breaker_member_ttl,
                        max_refunds=settings.breaker_max_refunds,
                    ),
                    snapshot=True,  # its reads add up only in one snapshot
                )
            except (DatabaseUnavailable, TransactionConflict):
                raise  # the task policy: logged, tried again at the next period
            except PgqError as exc:  # a read the role may not do: the member goes on
                if not warned:
                    logger.warning("metrics: group numbers unavailable error=%s", exc)
                warned = True
                return
            warned = False
            self.put(Numbers(status, word, clock()))

        return refresh
