"""What each page shows, read through the functions the CLI uses (`pgq.monitor`,
`pgq.store`).

No statement of its own: the overview is `status_all` and the last hour's
samples (plus the pending/real split of `check` for groups with dead rows),
the group page `status`, its samples of the span asked for, `breaker_info`,
`check` with its dead split and `audit`, the message page `message` and
`pgq.store.history.message_history`, the messages page
`pgq.store.messages.find` (a keyset page of a filter), a bulk action's
confirmation `fix_matching`, the topics page `pgq topics`'s `topics`.
The charts draw the samples the database keeps (`pgq.store.samples`, decision
0045): the overview's sparklines an hour of every group's, the group page's
charts the `?span=` asked for, with the breaker's OPEN spans from the same
history the timeline draws. The sampler thread writes the minute's sample of
every group no member sampled, while the dashboard's role may (a role that may
not is told once, and the charts show what members wrote).

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
from pgq.errors import DatabaseUnavailable, PermissionDenied, PgqError
from pgq.read_models import GroupSample, GroupStatus, MessageSummary, StatusAll, Topics
from pgq.records import BreakerState, MessageFilter
from pgq.store import database_now
from pgq.store import history as store_history
from pgq.store import lifecycle as store_lifecycle
from pgq.store import messages as store_messages
from pgq.store import samples as store_samples
from pgq.store.deadline import ReadDeadline
from pgq.web.charts import rates
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
    sample_every: float = 20.0  # the sampler's beat (samples are one a minute)
    chart_span: float = 3600.0  # what the overview's sparklines cover
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


def _throughput(samples: Sequence[GroupSample]) -> list[tuple[dt.datetime, float]]:
    return rates([(s.at, s.done) for s in samples])


def _charts(samples: Sequence[GroupSample], strip: Any) -> dict[str, Any]:
    """What the group page's charts draw: the four series of `samples`, the span
    they cover (the breaker timeline `strip` of the same span) and its OPEN spans."""
    return {
        "start": strip.start,
        "end": strip.end,
        "samples": len(samples),
        "shaded": [(s.start, s.end) for s in strip.spans if s.state == BreakerState.OPEN],
        "throughput": _throughput(samples),
        "lag": [(s.at, float(s.lag)) for s in samples],
        "oldest": [(s.at, s.oldest_ready_age_s or 0.0) for s in samples],
        "dead": [(s.at, float(s.dead)) for s in samples],
    }


def _id(value: int) -> int | None:
    """`value` if it can be a message id (a page bound), else None."""
    return value if 1 <= value <= store_messages.MAX_MESSAGE_ID else None


@dataclass
class Dashboard:
    engine: Engine
    options: WebOptions = field(default_factory=WebOptions)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._samples: tuple[float, dict[str, list[GroupSample]]] | None = None
        """The overview's last read of every group's samples, and when (`clock`)."""
        self.writes_samples = True
        """False once the database refused a sample (a role without INSERT on it)."""
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
        span = self.options.chart_span
        samples = self._overview_samples(engine, span)
        now = self._now(engine)
        start, end = now.timestamp() - span, now.timestamp()
        rows = []
        for g in groups:
            found = samples.get(g.group, [])
            rows.append(
                {
                    "status": g,
                    "live": g.live,
                    "oldest_ready": _span(g.oldest_ready_age_s),
                    "dead": self._dead_split(engine, g),
                    "throughput": [(at.timestamp(), v) for at, v in _throughput(found)],
                    "lag_points": [(s.at.timestamp(), float(s.lag)) for s in found],
                    "chart_start": start,
                    "chart_end": end,
                }
            )
        return {"groups": rows, "span": span, "now": now}

    def _overview_samples(self, engine: Engine, span: float) -> dict[str, list[GroupSample]]:
        """Every group's samples of the last `span`, read again at most every
        `sample_every` seconds: they change once a minute, and the overview of 500
        groups, updated every 2 s, read 30,000 rows each time."""
        with self._lock:
            kept = self._samples
        if kept is not None and self.clock() - kept[0] < self.options.sample_every:
            return kept[1]
        found = store_samples.all_samples(engine, span)
        with self._lock:
            self._samples = (self.clock(), found)
        return found

    def _dead_split(self, engine: Engine, g: GroupStatus) -> dict[str, int]:
        dead, b = g.counts.dead, g.breaker
        if dead == 0 or (b.state is not BreakerState.OPEN and not b.reconciling):
            # no reconciliation coming or owed: nothing is pending (`pending_scope`)
            return {"dead": dead, "pending": 0, "real": dead}
        return monitor.dead_split(engine, g.group, self.options.max_refunds)

    def sample(self) -> int:
        """This minute's sample of every group that has none (the sampler thread's
        beat); how many it wrote. Nothing once the database refused one."""
        if not self.writes_samples:
            return 0
        try:
            return self._within(store_samples.sample_every_group)
        except PermissionDenied as exc:
            self.writes_samples = False
            logger.warning(
                "web samples not written: the role may not (the charts show what members"
                " write) error=%r",
                str(exc),
            )
            return 0

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

    def group(self, name: str, window: float | None = None, span: float = 3600.0) -> dict[str, Any]:
        return self._within(self._group, name, window, span)

    def _group(
        self, engine: Engine, name: str, window: float | None, span: float
    ) -> dict[str, Any]:
        status = monitor.read_status(engine, name, member_ttl=self.options.member_ttl)
        info = monitor.breaker_info(
            engine, name, history_limit=HISTORY_LIMIT, probe_limit=PROBE_LIMIT
        )
        word, line, split = monitor.check_and_split(
            engine, name, self.options.max_refunds, member_ttl=self.options.member_ttl
        )
        now = self._now(engine)
        truncated = len(info["history"]) >= HISTORY_LIMIT
        samples = store_samples.group_samples(engine, name, span)
        return {
            "status": status,
            "breaker": info,
            "timeline": timeline(info, now=now, window=window, truncated=truncated),
            "charts": _charts(samples, timeline(info, now=now, window=span, truncated=truncated)),
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
