"""What `pgq status` and `pgq members` read, as frozen values: the typed side of DESIGN §7.

`pgq.monitor` builds these from one snapshot; the CLI's human output and the
dashboard read their fields, so mypy checks every use. Each has one `to_json()`
that makes the contract's JSON value (DESIGN §7): its keys in the documented
order, vocabulary words (`pgq.records`) as their plain strings, timestamps as
UTC ISO 8601 with `+00:00` (`iso`), absent values `None`. The public dict
functions (`pgq.status`, `pgq.monitor.members`, ...) are `to_json()` of these.

Timestamps stay `datetime`s here (aware, as the database gives them) until
`to_json()`; renderers and templates take them as they are.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pgq.records import BreakerState, LocalBreakerState

__all__ = [
    "Counts",
    "FrontierHolder",
    "GroupBreaker",
    "GroupSample",
    "GroupStatus",
    "HistoryLine",
    "JsonModel",
    "MemberStatus",
    "MessageHistory",
    "MessagePage",
    "MessageProbe",
    "MessageSummary",
    "StatusAll",
    "TopicGroup",
    "TopicInfo",
    "Topics",
    "Totals",
    "Transition",
    "iso",
    "json_default",
]


def iso(ts: dt.datetime | None) -> str | None:
    """`ts` as UTC ISO 8601 with `+00:00` (None stays None)."""
    if ts is None:
        return None
    if ts.tzinfo is None:  # timestamptz columns are always aware; be safe anyway
        ts = ts.replace(tzinfo=dt.timezone.utc)
    return ts.astimezone(dt.timezone.utc).isoformat()


@runtime_checkable
class JsonModel(Protocol):
    """A read model: a value with its contract JSON."""

    def to_json(self) -> Any: ...


def json_default(value: object) -> Any:
    """`json.dumps(..., default=json_default)`: a read model as its `to_json()`, so a
    model, or a list of them, dumps exactly as the dicts they stand for."""
    if isinstance(value, JsonModel):
        return value.to_json()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """One member of a group as `pgq members` lists it. `live`: a heartbeat within the
    member TTL (database clock), not left, and its session still there."""

    name: str
    live: bool
    local_breaker: LocalBreakerState
    last_seen: dt.datetime
    host: str
    pid: int
    started_at: dt.datetime
    left_at: dt.datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "live": self.live,
            "local_breaker": self.local_breaker.value,
            "last_seen": iso(self.last_seen),
            "host": self.host,
            "pid": self.pid,
            "started_at": iso(self.started_at),
            "left_at": iso(self.left_at),
        }


@dataclass(frozen=True, slots=True)
class GroupBreaker:
    """The group breaker as `status` shows it. `prober` and `next_probe_at` are None
    unless OPEN; `reconciling`: a close's refunds are still owed."""

    state: BreakerState
    since: dt.datetime | None
    prober: str | None
    epoch: int
    next_probe_at: dt.datetime | None
    reconciling: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "since": iso(self.since),
            "prober": self.prober,
            "epoch": self.epoch,
            "next_probe_at": iso(self.next_probe_at),
            "reconciling": self.reconciling,
        }


@dataclass(frozen=True, slots=True)
class Counts:
    """Rows of the group in each state now; `done` includes the pruned ones."""

    ready: int
    leased: int
    done: int
    dead: int
    dead_systemic: int

    def to_json(self) -> dict[str, int]:
        return {
            "ready": self.ready,
            "leased": self.leased,
            "done": self.done,
            "dead": self.dead,
            "dead_systemic": self.dead_systemic,
        }


@dataclass(frozen=True, slots=True)
class Totals:
    """Running counters since the group was created."""

    reclaimed: int
    released: int
    refunded: int

    def to_json(self) -> dict[str, int]:
        return {"reclaimed": self.reclaimed, "released": self.released, "refunded": self.refunded}


@dataclass(frozen=True, slots=True)
class FrontierHolder:
    """The backend with the oldest open transaction id in the cluster (`pg_stat_activity`):
    while it stays open no group's frontier passes its transaction."""

    pid: int
    age_s: float
    state: str | None
    datname: str | None
    usename: str | None
    application_name: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "age_s": self.age_s,
            "state": self.state,
            "datname": self.datname,
            "usename": self.usename,
            "application_name": self.application_name,
        }


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """`pgq status GROUP --json`: frontier, counts, totals, lag, breaker and members.

    `oldest_ready_age_s`: seconds the oldest row claimable now (ready with
    `available_at` passed, or leased with its lease run out) has been claimable,
    by the database clock; None when no row is.
    """

    group: str
    topic: str
    committed: int | None
    counts: Counts
    totals: Totals
    lag: int
    breaker: GroupBreaker
    members: tuple[MemberStatus, ...]
    frontier_held_by: FrontierHolder | None
    oldest_ready_age_s: float | None = None

    @property
    def live(self) -> int:
        """How many of `members` are live."""
        return sum(1 for m in self.members if m.live)

    @property
    def left(self) -> int:
        """How many of `members` left cleanly (`left_at` set): not counted as members."""
        return sum(1 for m in self.members if m.left_at is not None)

    @property
    def stalled(self) -> str | None:
        """Why nobody can make progress on the rows ready now, in words, or None: no
        live member; the group breaker open; every live member's local breaker open."""
        if self.oldest_ready_age_s is None:
            return None
        live = [m for m in self.members if m.live]
        if not live:
            return "no live member"
        if self.breaker.state is BreakerState.OPEN:
            return "the group breaker is open"
        if all(m.local_breaker is LocalBreakerState.OPEN for m in live):
            return "every live member's local breaker is open"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "topic": self.topic,
            "committed": self.committed,
            "counts": self.counts.to_json(),
            "totals": self.totals.to_json(),
            "lag": self.lag,
            "breaker": self.breaker.to_json(),
            "members": [m.to_json() for m in self.members],
            "frontier_held_by": (
                None if self.frontier_held_by is None else self.frontier_held_by.to_json()
            ),
            "oldest_ready_age_s": self.oldest_ready_age_s,
        }


@dataclass(frozen=True, slots=True)
class StatusAll:
    """`pgq status --json`: the status of every group, by name."""

    groups: tuple[GroupStatus, ...]

    def to_json(self) -> dict[str, Any]:
        return {"groups": [g.to_json() for g in self.groups]}


@dataclass(frozen=True, slots=True)
class TopicGroup:
    """One group of a topic, as `pgq topics` lists it (an `ordered` flag comes with
    ordered groups)."""

    name: str
    ordered: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"group": self.name, "ordered": True} if self.ordered else {"group": self.name}

    def __str__(self) -> str:
        return f"{self.name} (ordered)" if self.ordered else self.name


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """One topic, as `pgq topics` lists it: the messages it retains and its groups."""

    name: str
    messages: int
    groups: tuple[TopicGroup, ...]
    created_at: dt.datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.name,
            "messages": self.messages,
            "groups": [g.to_json() for g in self.groups],
            "created_at": iso(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class Topics:
    """`pgq topics --json`: every topic, by name."""

    topics: tuple[TopicInfo, ...]

    def to_json(self) -> dict[str, Any]:
        return {"topics": [tp.to_json() for tp in self.topics]}


@dataclass(frozen=True, slots=True)
class MessageSummary:
    """One row of a group's messages page: the delivery row, its message's key and
    publishing time, and the starts of its last error and payload (as JSON text)."""

    message_id: int
    state: str
    attempts: int
    reclaims: int
    refunds: int
    error_class: str | None
    error: str | None
    available_at: dt.datetime
    updated_at: dt.datetime
    lease_owner: str | None
    key: str | None
    created_at: dt.datetime
    payload: str

    def to_json(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "state": self.state,
            "attempts": self.attempts,
            "reclaims": self.reclaims,
            "refunds": self.refunds,
            "error_class": self.error_class,
            "error": self.error,
            "available_at": iso(self.available_at),
            "updated_at": iso(self.updated_at),
            "lease_owner": self.lease_owner,
            "key": self.key,
            "created_at": iso(self.created_at),
            "payload": self.payload,
        }


@dataclass(frozen=True, slots=True)
class MessagePage:
    """One page of a group's messages, in message id order (`descending`: newest
    first), as the keyset left it.

    `more`: rows past this page may match (`next_after`/`next_before` continue,
    whichever the direction needs); `searched_to`: the page looked through a
    bounded window (a filter without an index) and ended there without filling
    up, so the next page searches on from that id.
    """

    group: str
    topic: str
    rows: tuple[MessageSummary, ...]
    descending: bool
    more: bool
    searched_to: int | None
    now: dt.datetime

    @property
    def first_id(self) -> int | None:
        return self.rows[0].message_id if self.rows else None

    @property
    def last_id(self) -> int | None:
        """Where the next page starts from: the last row shown, or the end of the
        window searched when that is further."""
        if self.searched_to is not None:
            return self.searched_to
        return self.rows[-1].message_id if self.rows else None

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "topic": self.topic,
            "messages": [r.to_json() for r in self.rows],
            "order": "desc" if self.descending else "asc",
            "more": self.more,
            "searched_to": self.searched_to,
        }


@dataclass(frozen=True, slots=True)
class HistoryLine:
    """One line of a message's history in a group (`attempt`): what happened
    (`pgq.records.AttemptEvent`), when, to whose attempt or lease, and the row's
    counters after it."""

    n: int
    at: dt.datetime
    event: str
    member: str | None
    seconds: float | None
    error_class: str | None
    error: str | None
    epoch: int | None
    attempts: int
    reclaims: int
    refunds: int

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "at": iso(self.at),
            "event": self.event,
            "member": self.member,
            "seconds": self.seconds,
            "error_class": self.error_class,
            "error": self.error,
            "epoch": self.epoch,
            "attempts": self.attempts,
            "reclaims": self.reclaims,
            "refunds": self.refunds,
        }


@dataclass(frozen=True, slots=True)
class MessageProbe:
    """A group probe the message was taken for (`probe`)."""

    epoch: int
    at: dt.datetime
    member: str | None
    outcome: str
    error_class: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "at": iso(self.at),
            "member": self.member,
            "outcome": self.outcome,
            "error_class": self.error_class,
        }


@dataclass(frozen=True, slots=True)
class Transition:
    """A group breaker transition (`breaker_history`): the epoch it began, its state,
    when, how many rows its close refunded, and the member that made it."""

    epoch: int
    state: BreakerState
    at: dt.datetime
    refunded: int
    by_member: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "state": self.state.value,
            "at": iso(self.at),
            "refunded": self.refunded,
            "by_member": self.by_member,
        }


@dataclass(frozen=True, slots=True)
class MessageHistory:
    """What happened to a message in a group, oldest first: its history lines (at
    most `pgq.schema.HISTORY_SLOTS`, the newest; `lines_written` counts every line
    its row wrote, 0 where unknown), the probes it was taken for, and the breaker's
    transitions while it was there (from the one it was published under)."""

    lines: tuple[HistoryLine, ...]
    lines_written: int
    probes: tuple[MessageProbe, ...]
    breaker: tuple[Transition, ...]

    @property
    def lines_lost(self) -> int:
        """Lines written that the ring of slots no longer holds."""
        return max(self.lines_written - len(self.lines), 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "lines": [line.to_json() for line in self.lines],
            "lines_written": self.lines_written,
            "probes": [p.to_json() for p in self.probes],
            "breaker": [tr.to_json() for tr in self.breaker],
        }


@dataclass(frozen=True, slots=True)
class GroupSample:
    """One minute's sample of a group, as the charts draw it (decision 0045):
    `done` as `group_state.done_pruned` counts finished rows, `lag`, `dead`
    and the oldest claimable row's age then (None: no row was claimable)."""

    at: dt.datetime
    done: int
    lag: int
    dead: int
    oldest_ready_age_s: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "at": iso(self.at),
            "done": self.done,
            "lag": self.lag,
            "dead": self.dead,
            "oldest_ready_age_s": self.oldest_ready_age_s,
        }
