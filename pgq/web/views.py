"""What each page shows, read through the functions the CLI uses (`pgq.monitor`,
`pgq.store`).

No statement of its own: the overview is `status_all` (plus the pending/real
split of `check` for groups with dead rows), the group page `status`,
`breaker_info`, `check` with its dead split and `audit`, the message page
`message` and `pgq.store.history.message_history`, the messages page
`pgq.store.messages.find` (a keyset page of a filter), a bulk action's
confirmation `fix_matching`, the topics page `pgq topics`'s `topics`.
`Dashboard` also keeps the charts' `History`, fed by the sampler thread and
by every overview it reads.

Every read has a deadline (`read_timeout`, `pgq.store.deadline`): it runs on
a `pgq-web-read` thread over an engine of the dashboard's own, and a read still
running at the deadline is ended (its socket shut down) and answered "database
unavailable" (503). A database that stops answering without closing the
connection (a stalled network, a hung host) would otherwise hold every waitress
thread, `/healthz` included, or every reader thread, for good (docs/defects.md).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Engine

from pgq import monitor
from pgq.errors import DatabaseUnavailable, PgqError
from pgq.read_models import GroupStatus, MessageSummary, StatusAll, Topics
from pgq.records import BreakerState, MessageFilter
from pgq.store import database_now
from pgq.store import history as store_history
from pgq.store import lifecycle as store_lifecycle
from pgq.store import messages as store_messages
from pgq.store.deadline import ReadDeadline
from pgq.web.history import History, lag, throughput
from pgq.web.query import Position
from pgq.web.timeline import timeline

__all__ = ["Dashboard", "Listing", "WebOptions"]

logger = logging.getLogger(__name__)

HISTORY_LIMIT = 50
PROBE_LIMIT = 200
AUDIT_LIMIT = 50
READERS = 4
"""Threads that run the dashboard's reads (requests wait for them, with a deadline)."""

T = TypeVar("T")


def _span(seconds: float | None) -> str | None:
    return None if seconds is None else monitor.span(seconds)


@dataclass(frozen=True, slots=True)
class WebOptions:
    """How the dashboard reads: member liveness and refund cap as the CLI's settings
    say, how often pages update themselves and how often the charts sample."""

    member_ttl: float = monitor.DEFAULT_MEMBER_TTL
    max_refunds: int = monitor.DEFAULT_MAX_REFUNDS
    refresh: float = 2.0
    sample_every: float = 10.0
    chart_span: float = 3600.0
    group: str | None = None  # the group `/` opens on (`pgq demo --web`)
    read_timeout: float = 5.0  # a page whose reads take longer is a 503


@dataclass(frozen=True, slots=True)
class Listing:
    """One messages page as the page shows it: rows in the list's order, and where
    the neighbouring pages start (`next`/`prev` of a message id, None at an end).
    `searched_to`: a filter without an index looked through a bounded window that
    ended at this id without filling the page (the next page searches on)."""

    group: str
    topic: str
    rows: tuple[MessageSummary, ...]
    next: int | None
    prev: int | None
    searched_to: int | None
    now: dt.datetime


def listing(engine: Engine, group: str, f: MessageFilter, position: Position, scan: int) -> Listing:
    """The page `position` asks for: a `prev` page is read backwards and turned round.
    An empty page links back (or on) to the page that holds the row it started
    from: `next=5` found nothing, so "previous" is `prev=6`, the rows up to 5."""
    after, before, descending, backwards = position.bounds()
    page = store_messages.find(
        engine,
        group,
        f,
        after=after,
        before=before,
        descending=descending,
        limit=position.limit,
        scan=scan,
    )
    rows = page.rows
    onward = page.last_id if page.more else None
    step = -1 if position.descending else 1  # from a row to the bound just past it
    if not backwards:
        came = position.next
        back = None if came is None else (rows[0].message_id if rows else _id(came + step))
        return Listing(page.group, page.topic, rows, onward, back, page.searched_to, page.now)
    rows = rows[::-1]
    assert position.prev is not None
    forth = rows[-1].message_id if rows else _id(position.prev - step)
    return Listing(page.group, page.topic, rows, forth, onward, page.searched_to, page.now)


def _id(value: int) -> int | None:
    """`value` if it can be a message id (a page bound), else None."""
    return value if 1 <= value <= store_messages.MAX_MESSAGE_ID else None


@dataclass
class Dashboard:
    engine: Engine
    options: WebOptions = field(default_factory=WebOptions)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.history = History(self.options.chart_span, self.clock)
        self._sampled = float("-inf")
        self._lock = threading.Lock()
        self._unavailable = 0  # reads failed with DatabaseUnavailable since the last success
        self._closing = threading.Event()
        self._reads = ReadDeadline(self.engine, READERS, "pgq-web-read")

    def _within(self, read: Callable[..., T], *args: Any) -> T:
        """`read(engine, *args)` on a reader thread, ended after `read_timeout`
        (`DatabaseUnavailable`). A streak of unavailable reads is logged once, when
        it starts and when it ends: every open page asks every few seconds, and a
        line each time buried the news (docs/defects.md)."""
        try:
            result = self._reads.run(self.options.read_timeout, read, *args)
        except DatabaseUnavailable as exc:
            with self._lock:
                self._unavailable += 1
                first = self._unavailable == 1
            if first and not self._closing.is_set():
                logger.warning("web database unavailable error=%r", str(exc))
            raise
        with self._lock:
            failed, self._unavailable = self._unavailable, 0
        if failed:
            logger.warning("web database answers again failed_reads=%d", failed)
        return result

    def close(self) -> None:
        """Stop the reader threads and close the dashboard's connections."""
        self._closing.set()  # the reads it ends are no news
        self._reads.close()

    def health(self) -> dt.datetime:
        """The database clock, within the deadline."""
        return self._within(self._now)

    def status(self, group: str | None) -> StatusAll | GroupStatus:
        """`pgq status [GROUP]` (its `to_json()` is the `--json`), within the deadline."""
        return self._within(self._status, group)

    def _status(self, engine: Engine, group: str | None) -> StatusAll | GroupStatus:
        ttl = self.options.member_ttl
        if group is None:
            return monitor.read_status_all(engine, member_ttl=ttl)
        return monitor.read_status(engine, group, member_ttl=ttl)

    def status_all(self) -> StatusAll:
        """`pgq status` of every group, within the deadline."""
        return self._within(self._status_all)

    def _status_all(self, engine: Engine) -> StatusAll:
        return monitor.read_status_all(engine, member_ttl=self.options.member_ttl)

    # --- overview ---------------------------------------------------------------

    def overview(self) -> dict[str, Any]:
        return self._within(self._overview)

    def _overview(self, engine: Engine) -> dict[str, Any]:
        groups = self._status_all(engine).groups
        self._maybe_sample(groups)
        # the charts cover what has been watched (at least a minute), all groups alike
        start = self.clock() - max(self.history.watched(), 60.0)
        rows = []
        for g in groups:
            samples = self.history.samples(g.group)
            rows.append(
                {
                    "status": g,
                    "live": g.live,
                    "oldest_ready": _span(g.oldest_ready_age_s),
                    "dead": self._dead_split(engine, g),
                    "throughput": throughput(samples),
                    "lag_points": lag(samples),
                    "chart_start": start,
                    "chart_end": self.clock(),
                }
            )
        return {"groups": rows, "watched": self.history.watched(), "now": self._now(engine)}

    def _dead_split(self, engine: Engine, g: GroupStatus) -> dict[str, int]:
        dead, b = g.counts.dead, g.breaker
        if dead == 0 or (b.state is not BreakerState.OPEN and not b.reconciling):
            # no reconciliation coming or owed: nothing is pending (`pending_scope`)
            return {"dead": dead, "pending": 0, "real": dead}
        return monitor.dead_split(engine, g.group, self.options.max_refunds)

    def _maybe_sample(self, groups: Sequence[GroupStatus]) -> None:
        with self._lock:
            if self.clock() - self._sampled < self.options.sample_every * 0.5:
                return
            self._sampled = self.clock()
        self.history.record(groups)

    def sample(self) -> None:
        """One chart sample of every group (the sampler thread's beat)."""
        self._maybe_sample(self.status_all().groups)

    def run_sampler(self, stop: threading.Event) -> None:
        """Sample every `sample_every` seconds until `stop`; a failed read is logged
        once per failure streak and retried at the next beat. A read that fails
        because `close()` ended it is no news (docs/defects.md)."""
        failing = False
        while not stop.is_set():
            try:
                self.sample()
                failing = False
            except DatabaseUnavailable:
                pass  # logged by `_within`, once a streak
            except PgqError as exc:
                if not failing and not stop.is_set():
                    logger.warning("web sample failed error=%r", str(exc))
                failing = True
            stop.wait(self.options.sample_every)

    # --- group, message ---------------------------------------------------------

    def group(self, name: str, window: float | None = None) -> dict[str, Any]:
        return self._within(self._group, name, window)

    def _group(self, engine: Engine, name: str, window: float | None) -> dict[str, Any]:
        status = monitor.read_status(engine, name, member_ttl=self.options.member_ttl)
        info = monitor.breaker_info(
            engine, name, history_limit=HISTORY_LIMIT, probe_limit=PROBE_LIMIT
        )
        word, line, split = monitor.check_and_split(
            engine, name, self.options.max_refunds, member_ttl=self.options.member_ttl
        )
        now = self._now(engine)
        return {
            "status": status,
            "breaker": info,
            "timeline": timeline(
                info, now=now, window=window, truncated=len(info["history"]) >= HISTORY_LIMIT
            ),
            "probe_limit": PROBE_LIMIT,
            "dead_split": split,
            "check": {"state": word, "line": line},
            "oldest_ready": _span(status.oldest_ready_age_s),
            "audit": monitor.audit(engine, name, limit=AUDIT_LIMIT),
            "now": now,
        }

    def messages(
        self, group: str, f: MessageFilter, position: Position, scan: int = store_messages.SCAN
    ) -> dict[str, Any]:
        """The messages page: one `Listing` of filter `f` (no status: its counts read
        every row of the group, a hundred milliseconds on a million rows)."""
        return self._within(self._messages, group, f, position, scan)

    def _messages(
        self, engine: Engine, group: str, f: MessageFilter, position: Position, scan: int
    ) -> dict[str, Any]:
        found = listing(engine, group, f, position, scan)
        return {"listing": found, "now": found.now}

    def count(self, group: str, f: MessageFilter) -> tuple[int, MessageFilter | None]:
        """How many of `group`'s rows match `f`, and `f` bounded to those rows
        (`pgq.store.messages.fix_matching`)."""
        return self._within(store_messages.fix_matching, group, f)

    def topics(self) -> dict[str, Any]:
        """Every topic, as `pgq topics` lists it, and the database clock."""
        return self._within(self._topics)

    def _topics(self, engine: Engine) -> dict[str, Any]:
        found: Topics = store_lifecycle.topics(engine)
        return {"topics": found, "now": self._now(engine)}

    def audit_of(self, group: str) -> list[dict[str, Any]]:
        """The newest audit rows of `group`, also of one `unsubscribe` removed."""
        return self._within(self._audit_of, group)

    def _audit_of(self, engine: Engine, group: str) -> list[dict[str, Any]]:
        return monitor.audit(engine, group, limit=AUDIT_LIMIT)

    def message(self, group: str, message_id: int) -> dict[str, Any]:
        return self._within(self._message, group, message_id)

    def _message(self, engine: Engine, group: str, message_id: int) -> dict[str, Any]:
        found = monitor.message(engine, group, message_id)
        published = dt.datetime.fromisoformat(found["created_at"])
        history = store_history.message_history(engine, group, message_id, published)
        return {"message": found, "history": history, "now": self._now(engine)}

    @staticmethod
    def _now(engine: Engine) -> dt.datetime:
        value: dt.datetime = database_now(engine)
        return value
