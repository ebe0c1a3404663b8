"""The consumer's in-memory records: a claimed row and an attempt's outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pgq.message import Message

OutcomeKind = Literal["done", "retry", "dead", "snooze"]


@dataclass(slots=True, eq=False)
class Claimed:
    """A row this member holds a lease on: the message and its fencing token."""

    message: Message
    seq: int
    attempts: int
    """Finished attempts before this claim."""
    epoch: int = 0
    """The group breaker epoch the attempt started under."""
    probe: bool = False
    """This row is a breaker probe."""

    @property
    def id(self) -> int:
        return self.message.id

    @property
    def lease(self) -> tuple[int, int]:
        return (self.message.id, self.seq)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one attempt, waiting for the acker to write it."""

    claimed: Claimed
    kind: OutcomeKind
    delay: float = 0.0
    error_class: str | None = None
    error: str | None = None
