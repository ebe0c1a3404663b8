"""The records every layer passes around: frozen values at the bottom of pgq.

`Message` and `RunSummary` are public (handlers and callers see them); the
others travel between the store and the consumer's threads. This module
imports nothing from pgq, so any layer may use it.

It also holds pgq's one vocabulary: the words stored in the database and shown
in the JSON (DESIGN §7), each spelled once here as a `str` enum. A member *is*
its plain string (`==`, hashing, `str()`, f-strings and `json.dumps` all give
the value), so callers and readers that hold plain strings keep working.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Literal, NamedTuple

StopReason = Literal["empty", "max_messages", "max_runtime", "signal", "breaker_open"]
"""Why a run ended. `signal`: asked to stop from outside (SIGTERM/SIGINT, `stop()`)."""


class _Word(str, Enum):
    """A word of pgq's vocabulary: a `str` whose `str()` and format are its value
    (`enum.StrEnum` without needing Python 3.11)."""

    def __str__(self) -> str:
        return str.__str__(self)


class BreakerState(_Word):
    """The group breaker's state (`breaker.state`, DESIGN §6.2; `breaker.state` in
    the JSON). The order is the one of the table's CHECK constraint."""

    CLOSED = "CLOSED"
    OPEN = "OPEN"


class LocalBreakerState(_Word):
    """A member's local breaker (`member.local_breaker`, DESIGN §6.1): the values of
    `pgq.breaker.BreakerState`. The order is the one of the table's CHECK constraint."""

    OPEN = "open"
    CLOSED = "closed"


class Start(_Word):
    """Where a group's delivery starts (`subscribe(start=...)`, `consumer_group.start`):
    every retained message, or those published after it subscribed."""

    EARLIEST = "earliest"
    LATEST = "latest"


class RowState(_Word):
    """A delivery row's state (`delivery.state`)."""

    READY = "ready"
    LEASED = "leased"
    DONE = "done"
    DEAD = "dead"


class ErrorClass(_Word):
    """Why an attempt failed (`delivery.error_class`): the three classifications of
    `pgq.classify.Classification`, and `lease` for a row that died of expired leases."""

    SYSTEMIC = "systemic"
    MESSAGE = "message"
    PERMANENT = "permanent"
    LEASE = "lease"


class OutcomeKind(_Word):
    """What an attempt's outcome writes: done, a retry, dead, or a snooze (a retry
    that charges no attempt)."""

    DONE = "done"
    RETRY = "retry"
    DEAD = "dead"
    SNOOZE = "snooze"


class AttemptEvent(_Word):
    """A line of a message's history in a group (`attempt.kind`): an attempt that
    failed and will run again, one that failed for the last time, a snooze, a lease
    that expired without an outcome (the holder vanished), and a refund at the close
    of an outage. A success writes no line (the ack must cost nothing more): the
    message's state says it finished. The order is the one of the CHECK constraint."""

    FAILED = "failed"
    DIED = "died"
    SNOOZED = "snoozed"
    RECLAIMED = "reclaimed"
    REFUNDED = "refunded"


@dataclass(frozen=True, slots=True, init=False)
class Message:
    """One message as a handler receives it. `attempt` is 1-based."""

    id: int
    topic: str
    group: str
    key: str | None
    payload: Any
    headers: dict[str, Any] | None
    attempt: int
    created_at: dt.datetime

    def __init__(
        self,
        id: int,
        topic: str,
        group: str,
        key: str | None,
        payload: Any,
        headers: dict[str, Any] | None,
        attempt: int,
        created_at: dt.datetime,
    ) -> None:
        # the fields' slots set directly: one is built per claimed row, and the
        # frozen dataclass's own __init__ (`object.__setattr__` per field) costs
        # twice as much
        _id(self, id)
        _topic(self, topic)
        _group(self, group)
        _key(self, key)
        _payload(self, payload)
        _headers(self, headers)
        _attempt(self, attempt)
        _created_at(self, created_at)


_id, _topic, _group, _key, _payload, _headers, _attempt, _created_at = (
    getattr(Message, f.name).__set__ for f in fields(Message)
)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What one `Consumer.run()` did.

    `handled` counts finished attempts; `done`, `retried` and `dead` split them
    by the outcome written (a snooze is in `retried`), and `refused` counts the
    attempts whose outcome the database refused because the lease had been lost
    (another member reclaimed the row; its outcome stands). `released` counts
    rows handed back unstarted, `reclaimed` rows this member took back from
    expired leases, and `waiting_retry` the group's rows waiting for a later
    retry when the run ended.
    """

    handled: int
    done: int
    retried: int
    dead: int
    released: int
    reclaimed: int
    waiting_retry: int
    stop_reason: StopReason
    refused: int = 0


class Lease(NamedTuple):
    """What fences a held row: the message and its claim's token (a tuple:
    made and hashed per row on the hot path, several times per message)."""

    id: int
    seq: int


class Claimed(NamedTuple):
    """A row this member holds a lease on: the message and its lease (a tuple: one is
    made per claimed row, and a tuple is made ~3 times faster than a frozen
    dataclass; the lease is made once with it, and read several times per message)."""

    message: Message
    lease: Lease
    """The message's id and this claim's fencing token."""
    attempts: int
    """Finished attempts before this claim."""
    epoch: int = 0
    """The group breaker epoch the attempt started under."""
    probe: bool = False
    """This row is a breaker probe."""
    unreadable: str | None = None
    """Why the stored message could not be decoded (its payload is then None): the
    handler is not called and the attempt fails as `permanent`."""
    claimed_at: float = math.inf
    """When the claim that leased it began (`time.monotonic()`): a lease later its
    lease may have lapsed, unless an extension kept it (`Member.lease_lapsed`).
    Infinite (never lapsed) for a row made otherwise."""

    @property
    def id(self) -> int:
        return self.message.id

    @property
    def seq(self) -> int:
        """The claim's fencing token."""
        return self.lease.seq


class Outcome(NamedTuple):
    """What became of one attempt, waiting for the acker to write it (a tuple, like
    `Claimed`: one per attempt)."""

    claimed: Claimed
    kind: OutcomeKind
    delay: float = 0.0
    error_class: str | None = None
    error: str | None = None
    seconds: float | None = None
    """How long a failed attempt's handler ran (its history line says it); None
    where not measured, and on a success (nothing records it)."""


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A consumer group as stored: its id, name, topic and topic id, and whether it is
    ordered (DESIGN §7)."""

    id: int
    name: str
    topic: str
    topic_id: int
    ordered: bool


@dataclass(frozen=True, slots=True)
class DrainState:
    """What stands between a member and an empty group."""

    ready_now: int
    waiting_retry: int
    due_soon: int
    """Rows waiting for a retry that comes due within the wait asked for."""
    held: int
    reconciling: bool
    """A close still owes a reconciliation (its refunds are not all made)."""

    @property
    def empty(self) -> bool:
        """Nothing for this run to wait for: no row ready now, none held by a live
        member, no retry due within the wait, and no reconciliation owed."""
        return self.ready_now + self.held + self.due_soon == 0 and not self.reconciling


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


@dataclass(frozen=True, slots=True)
class MessageFilter:
    """Which of a group's delivery rows to find (the dashboard's messages page, and
    the bulk requeue and purge of "every dead row that matches"). Every field left
    None matches everything; the ones given must all match.

    `key` and `dedupe_key` match the message's key and dedupe key exactly (the
    latter through `message_dedupe_key_idx`: at most one retained message of the
    topic has it); `error` is a case-insensitive part of the last error text; `field` a payload
    path (`customer.id`: keys separated by dots) whose value, as text, is `value`
    (`{"n": 1}` matches `n` = `1`); `published_from` (inclusive) and
    `published_to` (exclusive) bound the message's `created_at`; `up_to` is the
    highest message id and `changed_by` the latest last change (`updated_at`,
    the database clock): a confirmation page fixes both, so rows published or
    dead after it was drawn are not swept up (a row's death is a change, and an
    older row may die later: decision 0041).
    """

    message_id: int | None = None
    key: str | None = None
    dedupe_key: str | None = None
    state: str | None = None
    error_class: str | None = None
    error: str | None = None
    field: str | None = None
    value: str | None = None
    published_from: dt.datetime | None = None
    published_to: dt.datetime | None = None
    up_to: int | None = None
    changed_by: dt.datetime | None = None

    def shape(self) -> frozenset[str]:
        """The names of the fields given (statements are built once per shape), with
        the state's own word: a state is matched as a literal so that the planner
        can use the partial indexes of ready, leased and failed rows."""
        given = {f.name for f in fields(self) if getattr(self, f.name) is not None}
        if self.state is not None:
            given.add(f"state={self.state}")
        return frozenset(given)

    def path(self) -> list[str]:
        """`field` as the list of keys `#>>` takes."""
        return [] if self.field is None else self.field.split(".")
