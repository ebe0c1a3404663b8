"""What the overview's small charts draw: each group's done count and lag, sampled.

pgq keeps no history table: the dashboard samples `pgq status` itself (the
`pgq-web-sampler` thread, every `every` seconds) and keeps the last `span`
seconds in memory, so the charts cover the last hour the dashboard has been
watching (docs/decisions/0024-web-dashboard.md says why). Throughput is the
growth of `counts.done` between two samples; it never goes negative (a group
dropped and created again under the same name starts over).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pgq.read_models import GroupStatus

__all__ = ["History", "Sample"]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # seconds on the history's clock
    done: int
    lag: int


class History:
    """The last `span` seconds of samples per group; thread-safe; injectable clock."""

    def __init__(self, span: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.span = span
        self.clock = clock
        self._lock = threading.Lock()
        self._groups: dict[str, deque[Sample]] = {}

    def record(self, groups: Iterable[GroupStatus]) -> None:
        """One sample of every group in a `read_status_all().groups`; groups no
        longer listed are forgotten."""
        now = self.clock()
        with self._lock:
            seen = set()
            for g in groups:
                name = g.group
                seen.add(name)
                samples = self._groups.setdefault(name, deque())
                samples.append(Sample(now, g.counts.done, g.lag))
                while samples and samples[0].at < now - self.span:
                    samples.popleft()
            for gone in self._groups.keys() - seen:
                del self._groups[gone]

    def samples(self, group: str) -> list[Sample]:
        with self._lock:
            return list(self._groups.get(group, ()))

    def watched(self) -> float:
        """Seconds of history held (0 before the second sample), at most `span`."""
        with self._lock:
            starts = [s[0].at for s in self._groups.values() if s]
        return min(self.clock() - min(starts), self.span) if starts else 0.0


def throughput(samples: list[Sample]) -> list[tuple[float, float]]:
    """(at, messages per second) between consecutive samples."""
    rates = []
    for a, b in itertools.pairwise(samples):
        dt = b.at - a.at
        if dt > 0:
            rates.append((b.at, max(b.done - a.done, 0) / dt))
    return rates


def lag(samples: list[Sample]) -> list[tuple[float, float]]:
    return [(s.at, float(s.lag)) for s in samples]
